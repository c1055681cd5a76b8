# The reference's container: a PyTorch base image, the code in /workspace/unet3d, and volumes
# for the raw data, the preprocessed data and the results.
#   docker build -t unet3d .
#   docker build --build-arg BASE_IMAGE=rocm/pytorch:<tag> -t unet3d .   # AMD GPUs
# The base image's torch (and numpy) are kept: scripts/install_requirements.sh pins them.
ARG BASE_IMAGE=pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace/unet3d

# Dependencies in their own layer, before the code: editing the code does not reinstall them.
COPY requirements.txt scripts/install_requirements.sh /tmp/install/
RUN bash /tmp/install/install_requirements.sh /tmp/install/requirements.txt \
    && rm -rf /tmp/install

# An unprivileged user owns the mount points; the code stays root's and read-only to it.
# USER_ID lets the files written to /results belong to the host user (or `docker run --user`):
# unet3d gets exactly that uid, shared (--non-unique) with a user of the base that has it.
ARG USER_ID=1000
RUN useradd --create-home --non-unique --uid "${USER_ID}" unet3d \
    && test "$(id -u unet3d)" = "${USER_ID}" \
    && mkdir -p /raw_data /data /results \
    && chown unet3d /raw_data /data /results

# What goes in is .dockerignore's allow-list, the same as apptainer.def's %files.
COPY . .

USER unet3d
# run_and_time.sh reads the dataset mounted at /data (as the reference's image), writes its logs,
# checkpoint and embedded dataset (DATASET_DIR= asks for it) under /results, and so does main.py
# without --log_dir (the code folder is not the user's to write).
ENV DATASET_DIR=/data \
    RESULTS_DIR=/results \
    SYNTHETIC_DIR=/results/synthetic-kits19 \
    UNET3D_LOG_DIR=/results
VOLUME ["/raw_data", "/data", "/results"]
CMD ["bash"]
