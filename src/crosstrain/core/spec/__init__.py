"""The plan: its records, its checks, and its TOML and dict forms."""
