"""Installs AutoDist. Generated protobuf modules are checked in (see scripts/gen_protos.py)."""
from setuptools import find_packages, setup

setup(
    name="autodist",
    version="0.1.0",
    description="Distributed training of single-device TensorFlow models by explicit strategies",
    python_requires=">=3.11",
    packages=find_packages(include=["autodist", "autodist.*"]),
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "protobuf>=7.35.1",
        "numpy",
        "PyYAML",
        "grpcio>=1.85",
        "matplotlib",  # the strategy search's plot (search.png)
    ],
    entry_points={"console_scripts": ["autodist=autodist.cli:main"]},
    extras_require={
        # The model libraries are the test corpus's: users' models built from their code.
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "grpcio-tools>=1.85",
                 "keras-hub>=0.32", "keras-rs>=0.4", "tf-keras>=2.21,<2.22",
                 "tensorflow-recommenders>=0.7.7"],
    },
)
