from setuptools import setup

setup(
    cffi_modules=["native/build_kernels.py:ffibuilder"],
    # pccl._kernels is built against the stable ABI (py_limited_api in build_kernels.py): tag the
    # wheel abi3 so one build serves every CPython >= 3.11.
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
