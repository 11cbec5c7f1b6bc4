"""The model a plan describes: layers, the graph they form, widths and optimizers."""
