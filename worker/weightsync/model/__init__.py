"""The model and the bytes of a version: the flat layout every rank agrees on (names, shapes,
dtypes, offsets), the causal LM the built-in roles train and serve, its transformers config, the
toy data the built-in trainer learns from, and the native float32 -> bfloat16 cast. Imports torch;
nothing here knows about ranks, plans or the network."""
