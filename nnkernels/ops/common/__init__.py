"""What the kernels of several layers share: tensor-core products, tiles, TMA, layout copies, launch checks
and host math."""
