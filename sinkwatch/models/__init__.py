"""Loading a model: a hub id or a local folder at a revision (``loading``), and real trained models shipped as
GGUF files, dequantised once into a plain folder (``gguf``)."""
