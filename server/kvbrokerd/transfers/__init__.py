"""Transfers: validate a request, plan it as runs, claim and pin its blocks, run it on a backend, report what
landed."""
