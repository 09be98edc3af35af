import gc
import sys

from pipeline.cli import main

code = main()
gc.freeze()  # no collections over the imports' objects at exit, as pipeline/stage.py (bench.stage_startup)
sys.exit(code)
