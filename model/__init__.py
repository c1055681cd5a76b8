"""Network, loss and metric of the 3D U-Net benchmark."""
