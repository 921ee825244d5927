"""Package discovery only (metadata lives in pyproject.toml).

`kernels/` is installed under the import name `lm_kernels` so that it cannot shadow Hugging Face's
`kernels` package, which transformers probes for at import time.
"""
from setuptools import find_packages, setup

packages = find_packages(include=["lm", "lm.*"])
packages += ["lm_kernels"] + [f"lm_kernels.{p}" for p in find_packages(where="kernels")]

setup(
    packages=packages,
    package_dir={"lm": "lm", "lm_kernels": "kernels"},
    package_data={"lm": ["eval/tasks/**/*", "py.typed"]},
    include_package_data=True,
)
