"""The package list, found rather than listed (pyproject.toml holds everything else):
fa_lab/ and its subpackages, kernels/ with its families, installed as fa_lab.kernels, and
the bug report's own tables (data/seed/), installed as fa_lab._seed so that an installed
fa_lab prints them beside its own (``fa_lab.studies.experiments.seed_table``)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["fa_lab", "fa_lab.*"]), "fa_lab.kernels",
              *(f"fa_lab.kernels.{p}" for p in find_packages("kernels")), "fa_lab._seed"],
    package_dir={"fa_lab": "fa_lab", "fa_lab.kernels": "kernels", "fa_lab._seed": "data/seed"},
)
