"""Integrations of kvbroker with model servers. Each submodule imports its server lazily: importing `kvbroker` or
this package never imports one (`kvbroker.integrations.vllm` needs vLLM installed)."""
