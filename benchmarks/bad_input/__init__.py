"""The bad-input battery (benchmarks/bad_input_battery.py), one module per area of the public surface.

registry.py declares a case; helpers.py and ranks.py hold what the cases share; each area module registers
its cases (CASES: its groups of cases, SMOKE: the few that --smoke runs); runner.py runs and classifies them.
"""
