"""The package list, found rather than listed (pyproject.toml holds everything else):
fa_lab/ and its subpackages, and kernels/ with its families, installed as fa_lab.kernels."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["fa_lab", "fa_lab.*"]), "fa_lab.kernels",
              *(f"fa_lab.kernels.{p}" for p in find_packages("kernels"))],
    package_dir={"fa_lab": "fa_lab", "fa_lab.kernels": "kernels"},
)
