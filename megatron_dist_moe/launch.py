"""`python -m megatron_dist_moe.launch <pretrain script> ...`: alias of megatron_dist_moe.megatron.launch."""

from .megatron.launch import main

if __name__ == "__main__":
    main()
