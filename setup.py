"""Package discovery only (metadata lives in pyproject.toml): `lm` and `lm_kernels` (the Triton kernels,
named so that they never shadow Hugging Face's `kernels` package, which transformers probes for)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["lm", "lm.*", "lm_kernels", "lm_kernels.*"]),
    package_data={
        "lm": ["py.typed", "configs/*/*.json", "configs/*/*.yaml", "configs/*/*.txt", "eval/tasks/**/*",
               "data/default_tokenizer/*"],
    },
    include_package_data=False,
)
