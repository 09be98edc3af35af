"""The pipeline's stages, one module each: a params class and a `run` function with explicit input
and output paths. They import nothing of the orchestration layer (pipeline/), so each runs alone."""
