"""Code a user would write in their own package: each file adds one part to scgrpo without touching the package."""
