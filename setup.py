from setuptools import setup

setup(cffi_modules=["native/build_kernels.py:ffibuilder"])
