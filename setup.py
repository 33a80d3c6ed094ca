from setuptools import find_packages, setup

# The simulator lives in sim/ and installs as pccl_sim (a top-level "sim" in site-packages could
# shadow a user's own module): the package-directory mapping renames it, files stay where they are.
SIM_PACKAGES = ["pccl_sim" + name[len("sim"):] for name in find_packages(include=["sim", "sim.*"])]

setup(
    packages=find_packages(include=["pccl", "pccl.*"]) + SIM_PACKAGES,
    package_dir={"pccl_sim": "sim"},
    cffi_modules=["native/build_kernels.py:ffibuilder"],
    # pccl._kernels is built against the stable ABI (py_limited_api in build_kernels.py): tag the
    # wheel abi3 so one build serves every CPython >= 3.11.
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
