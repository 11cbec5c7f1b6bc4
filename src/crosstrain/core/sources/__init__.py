"""Data sources that turn files people already have (tables, text) into the arrays and token
files the rest of crosstrain reads; each reads its files with an optional package, imported
only when a plan names the source."""
