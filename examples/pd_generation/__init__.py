"""Disaggregated generation: a prefill process and a decode process share one transformer's KV cache through two
kvbrokerd daemons. `python -m examples.pd_generation` runs it; see README.md next to this file."""
