# megatron-metp on NVIDIA's PyTorch container: Megatron-LM core_v0.19.0 (default) or core_v0.16.1,
# patched for METP with that release's series (patches/<tag>/).
#
#   docker build -t megatron-metp .                                            # core_v0.19.0
#   docker build --build-arg MEGATRON_LM_TAG=core_v0.16.1 -t megatron-metp:0.16 .  # core_v0.16.1
#   docker build --build-arg MEGATRON_LM_TAG=core_v0.16.1 \
#       --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3 -t megatron-metp:0.16 .
#
# Layout inside the image (what scripts/slurm/srun_pretrain_gpt.sh assumes with CONTAINER_IMAGE):
#   /opt/Megatron-LM     Megatron-LM at the tag with its patches applied ($MEGATRON_LM_DIR)
#   /opt/megatron-metp   this repository's scripts/, configs/ and patches/ ($METP_DIR);
#                        the megatron_metp package is installed into the image's Python
#
# The base image's torch, Transformer Engine, apex and NCCL are kept: this package is installed
# with --no-deps, and its few missing pure-Python dependencies under a constraints file that pins
# every package already installed, so pip cannot replace any of them.
#
# Default base: the image Megatron-LM's own CI builds from at core_v0.19.0
# (docker/.ngc_version.dev, 26.06-py3; its LTS image is 25.09-py3). At core_v0.16.1 that CI image
# was 25.11-py3; the 0.16.1 checkout is pure Python and runs on either (Python >= 3.10).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_LM_REPO=https://github.com/NVIDIA/Megatron-LM.git
ARG MEGATRON_LM_TAG=core_v0.19.0

ENV MEGATRON_LM_DIR=/opt/Megatron-LM \
    METP_DIR=/opt/megatron-metp \
    CUDA_DEVICE_MAX_CONNECTIONS=1

# Megatron-LM at the tag. pretrain_gpt.py runs from this checkout, whose megatron/core shadows any
# megatron-core wheel; PYTHONPATH makes the same copy importable everywhere (python -m ...).
RUN git clone --depth 1 --branch "${MEGATRON_LM_TAG}" "${MEGATRON_LM_REPO}" "${MEGATRON_LM_DIR}"
ENV PYTHONPATH=/opt/Megatron-LM

# Only what the image needs from this repository (not .venv/, tests/ or benchmarks/).
COPY pyproject.toml README.md ${METP_DIR}/
COPY megatron_metp ${METP_DIR}/megatron_metp
COPY patches ${METP_DIR}/patches
COPY scripts ${METP_DIR}/scripts
COPY configs ${METP_DIR}/configs

# Patch the checkout: picks the series by the commit (refuses other tags), runs `git apply
# --check` first, idempotent.
RUN bash "${METP_DIR}/scripts/apply_patches.sh" "${MEGATRON_LM_DIR}"

# Install megatron_metp without touching the image's packages. PIP_CONSTRAINT is cleared so the
# base image's own constraint file cannot conflict with the list built here.
RUN python -m pip list --format=freeze > /tmp/installed.txt \
    && PIP_CONSTRAINT= python -m pip install --no-cache-dir -c /tmp/installed.txt \
        einops six regex pyyaml pydantic pybind11 \
    && PIP_CONSTRAINT= python -m pip install --no-cache-dir --no-deps "${METP_DIR}" \
    && rm /tmp/installed.txt \
    && python -c "import megatron.core, megatron_metp.megatron_lm as m; print('megatron.core from', megatron.core.__file__); print('megatron_metp', m.__name__, 'ok')"

WORKDIR ${METP_DIR}
