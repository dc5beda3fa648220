"""The package list, found rather than listed (pyproject.toml holds everything else):
fa_lab/ and its subpackages, kernels/ with its families, installed as fa_lab.kernels, and
the bug report's own tables (data/seed/), installed as fa_lab._seed so that an installed
fa_lab prints them beside its own (``fa_lab.studies.experiments.seed_table``); and the
course, the lessons (notebooks/) and the data they read (data/), as fa_lab._course, so that
``fa-lab lab`` from a wheel opens the lessons (``fa_lab.results.ROOT`` is that folder when
no checkout holds the package)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["fa_lab", "fa_lab.*"]), "fa_lab.kernels",
              *(f"fa_lab.kernels.{p}" for p in find_packages("kernels")), "fa_lab._seed",
              "fa_lab._course.notebooks", "fa_lab._course.data"],
    package_dir={"fa_lab": "fa_lab", "fa_lab.kernels": "kernels", "fa_lab._seed": "data/seed",
                 "fa_lab._course.notebooks": "notebooks", "fa_lab._course.data": "data"},
)
