"""Loading a model: a hub id or a local folder at a revision (``loading``); talking to the hub: commit ids, refs, a
revision's files before any download, retries (``hub``); where a model fits on the devices (``placement``); LitGPT
checkpoints (``litgpt_checkpoints``); and real trained models shipped as GGUF files, dequantised once into a plain
folder (``gguf``)."""
