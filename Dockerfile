FROM pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime
WORKDIR /workspace/unet3d
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
