"""Data sources that turn files people already have (image folders, tables, text) into the
rows the rest of crosstrain reads; each reads its files with an optional package, imported
only when a plan names the source."""
