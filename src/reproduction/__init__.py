"""The reproduction scorecard: every number the four papers state in their evaluation,
ours beside it, and a verdict by one rule (`python -m src.reproduce`).

catalogue: the headline catalogue (benchmarks/reproduction/<paper>.yaml), checked against
the figure presets it names; verdict: the rule; results: the figures' results.json, checked
against the presets that wrote them; scorecard: rows, counts, table, JSON and plot.
"""
