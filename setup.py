from setuptools import setup

# Tested ends: torch 2.11 (GPU image) and 2.13 (CPU); transformers 5.17 (GPU image, CPU) and 5.24 (CPU); TRL 1.14.1
# (CI's second venv, with transformers 5.17) and 1.16. TRL 1.15.0 scores through a Triton-only kernel: GPU only.
TRL = ["trl>=1.14.1,<1.17", "accelerate>=1.15,<1.16", "peft>=0.17,<0.22", "datasets>=3"]
EXAMPLES = TRL + ["matplotlib>=3.7", "pillow>=10"]
DEEPSPEED = ["deepspeed>=0.19,<0.20"]

setup(
    name="hf-prefixflow",
    version="0.1.0",
    description="Training-time KV caching for long-prefix GRPO on the HuggingFace stack",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The TRL adapters live in trainers/ and install as hf_prefixflow.trainers (no top-level `trainers`).
    packages=["hf_prefixflow", "hf_prefixflow.core", "hf_prefixflow.models", "hf_prefixflow.planning",
              "hf_prefixflow.distributed", "hf_prefixflow.trainers"],
    package_dir={"hf_prefixflow.trainers": "trainers"},
    python_requires=">=3.10",
    install_requires=["torch>=2.11,<2.14", "transformers>=5.17,<5.25"],
    extras_require={
        "trl": TRL,
        "examples": EXAMPLES,
        "deepspeed": DEEPSPEED,
        # prefix_grouper: the peer benchmarks/prefix_grouper_step.py compares with; its tests cross-check against it
        "dev": EXAMPLES + DEEPSPEED + ["pytest>=8", "nbformat>=5", "nbclient>=0.9", "ipykernel>=6",
                                       "prefix_grouper==0.0.1.post1"],
    },
)
