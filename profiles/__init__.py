"""Platform profiles (TOML data files), shipped inside the wheel as package `boxwarden_profiles`."""
