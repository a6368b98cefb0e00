"""megarl: RL post-training for LLMs on Megatron-core, with TensorRT-LLM or a built-in rollout engine.

torch is required as `torch>=2.4` so a cluster's own CUDA build is kept; the README's commands
install the CPU build (2.13.0) first on machines without a GPU.
"""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training (PPO/GRPO) on Megatron-core with TensorRT-LLM or a built-in rollout engine",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    package_data={"megarl": ["py.typed", "**/*.yaml", "**/*.jinja", "**/*.json", "**/*.jsonl"]},
    install_requires=[
        "torch>=2.4",
        # 0.16.1 is the newest for Python 3.11 (CI); 0.17-0.19 need Python >= 3.12. megarl checks
        # the features it uses (megarl/models/mcore.py) instead of pinning one version.
        "megatron-core>=0.16.1,<0.20",
        "transformers>=4.56",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "psutil>=5.9",                     # megatron-core's distributed-checkpoint writer needs it
        "pyyaml>=6",
        "ray>=2.40",
        "numpy>=1.26",
        "pyarrow>=14",                     # parquet datasets
        "matplotlib>=3.8",                 # the reward-curve PNG
        # verl's recipes copy keys with ${oc.select:...}: megarl/config/recipe_keys.py resolves them
        # with OmegaConf itself (also what verl's config classes, the core_algos oracle, build on)
        "omegaconf>=2.3",
    ],
    extras_require={
        # The 1.3 line megarl was written against (1.3.0rc21, what NeMo-RL 7ea279a pins); not yet run
        # against it. PyPI holds only a stub for it: the wheel comes from NVIDIA's index
        # (pip install 'megarl[trtllm]' --extra-index-url https://pypi.nvidia.com), see docs/trtllm.md.
        "trtllm": ["tensorrt-llm>=1.3.0rc21,<1.4"],
        "te": ["transformer-engine[pytorch]"],
        "logging": ["tensorboard", "wandb"],
        # checkpoint_engine.delta_compression=zstd|lz4 (delta weight syncs, docs/weight-sync.md)
        "compress": ["zstandard>=0.22", "lz4>=4"],
        # the suite runs the compressed syncs too, so the test extras take the compress ones
        # peft: the LoRA oracle (tests/test_lora.py); orjson: verl's tracking module imports it on the
        # way to core_algos, the oracle of tests/test_verl_core_algos.py (verl is installed --no-deps)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "zstandard>=0.22", "lz4>=4", "peft>=0.17,<1", "orjson>=3.9"],
    },
    entry_points={"console_scripts": ["megarl-train=megarl.train:program"]},
)
