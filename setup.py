from setuptools import find_packages, setup

setup(
    name="hf-prefixflow",
    version="0.1.0",
    description="Training-time KV caching for long-prefix GRPO on the HuggingFace stack",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hf_prefixflow", "hf_prefixflow.*", "trainers", "trainers.*"]),
    python_requires=">=3.10",
    # Tested ends: torch 2.11 (GPU image) and 2.13 (CPU); transformers 5.17 (GPU image) and 5.24 (CPU).
    install_requires=[
        "torch>=2.11,<2.14",
        "transformers>=5.17,<5.25",
        "accelerate>=1.15,<1.16",
        "peft>=0.17,<0.22",
        "trl>=1.16,<1.17",
        "datasets>=3",
        "matplotlib>=3.7",
    ],
    extras_require={
        "deepspeed": ["deepspeed>=0.19,<0.20"],
        "dev": ["pytest>=8", "nbformat>=5", "nbclient>=0.9", "ipykernel>=6", "deepspeed>=0.19,<0.20"],
    },
)
