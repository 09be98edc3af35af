"""The decoding engine: translator.py's Translator(model, device, precision).translate_batch(token ids),
beam_search.py, the decoder's step (step.py) and its key/value cache (cache.py). Each backend (cpu.py:
fp32 on packed weights, int8; cuda.py) is a set of transforms (transforms.py and its own) applied to the
plain trained model from outside, choosing its own kernels."""
