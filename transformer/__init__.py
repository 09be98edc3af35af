"""The Transformer of "Attention Is All You Need" in plain PyTorch: config.py (its hyperparameters,
which import no torch), attention.py, layers.py, model.py, loss.py, schedule.py.

Nothing here knows about files, tracking, distributed training or decoding kernels: those belong to
the stages and to the decoding engine (translate/), which apply them to the model from outside.
"""
