import gc
import sys

from pipeline.cli import main

code = main()
gc.freeze()  # no collections over Prefect's, MLflow's and torch's objects at exit (as pipeline/stage.py)
sys.exit(code)
