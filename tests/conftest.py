import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))  # synthetic tasks
os.environ.setdefault("HF_HUB_OFFLINE", "1")
