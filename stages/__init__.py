"""The pipeline's stages, one module each with a `run` function taking its params (stages/params.py)
and explicit input and output paths. They import nothing of the orchestration layer (pipeline/), so
each runs alone."""
