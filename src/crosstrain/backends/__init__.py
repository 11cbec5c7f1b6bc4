"""Built-in backends. Each folder is a plugin registered through the ``crosstrain`` entry
points, exactly as a third-party backend is; nothing outside a folder imports it."""
