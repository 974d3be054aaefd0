"""Predict a job before running it: a cluster file, per-action costs, the schedule simulator.

mpihybrid predict jobs/a100_gpt.toml --cluster clusters/a100_80gb.toml
"""
