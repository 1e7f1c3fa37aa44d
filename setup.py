from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="mmpipe",
    version="0.1.0",
    description="Train vision-language models (ViT + projector + decoder LM) as DeepSpeed pipelines",
    packages=find_packages(include=["mmpipe", "mmpipe.*"]),
    package_data={"mmpipe": ["presets/*.json"]},
    # the shipped DeepSpeed configs, for installs that are not a source checkout
    data_files=[("share/mmpipe/ds_configs", sorted(str(p) for p in Path("ds_configs").glob("*.json")))],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.15",
        "torchvision>=0.19,<0.30",
        "deepspeed>=0.19.8,<0.20",
        "transformers>=4.46,<6",
        "matplotlib>=3.5",  # mmpipe bench: plots
        "datasets>=3.0,<6",
        "pillow>=10",
        "safetensors>=0.4",
        "peft>=0.17,<0.22",  # --lora: its LoRA layers inside the pipeline layers (mmpipe.model.lora)
        "tqdm>=4.66",
        # video clips (mmpipe.data.video): PyAV's wheels bundle FFmpeg, and torchvision >= 0.26 decodes no video
        "av>=14",
    ],
    extras_require={
        "tensorboard": ["tensorboard>=2.14"],  # the DeepSpeed config's "tensorboard" monitor section
        # trl: tests/test_dpo.py compares --objective dpo with TRL's DPOTrainer loss
        "test": ["pytest>=8", "pytest-xdist>=3.5", "ruff>=0.6", "tensorboard>=2.14", "trl>=1.16"],
    },
    entry_points={"console_scripts": ["mmpipe=mmpipe.cli:main"]},
)
