"""Data sources read from the files people already have (image folders, tables, text)."""
