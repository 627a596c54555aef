"""The compiled part of cachefs, cachefs/_readpool.c (cachefs/read_pool.py says why); the rest
of the package is described in pyproject.toml. `optional`: without a C compiler the package
installs anyway, and the source is read in Python worker threads."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cachefs._readpool", ["cachefs/_readpool.c"], optional=True)])
