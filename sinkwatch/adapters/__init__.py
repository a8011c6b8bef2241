"""One adapter per training framework (docs/live.md), each a thin layer over the live core (``sinkwatch.live``):
``hf`` (the HF Trainer), ``lightning``, ``fabric`` (Lightning Fabric, LitGPT; ``fabric_factory`` for
``litgpt pretrain``), ``olmo_core``, ``torchtitan``, ``megatron``. Each imports its framework, so import the
one you use: ``from sinkwatch.hf import SinkWatchTrainerCallback`` (the short paths are ``sinkwatch._moved``'s)."""
