"""boxwarden's performance figures (DESIGN.md §9), run with `python -m bench` (`make bench`).

Each figure is measured as a ratio against a named baseline timed in the same run, on the same
files, interleaved run by run, so a noisy or slow machine moves both sides together. One module
per figure; `bench.__main__` holds the registry, prints the table and writes bench/results.json.
"""
