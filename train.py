"""Train any image model of the zoo, on one device, on several GPUs, or under torchrun.

    python train.py --model densenet --efficient True --dataset shapes --image_size 16 --epochs 3
    python train.py --model densenet --efficient True --dataset cifar10 --data_dir data
    torchrun --nproc_per_node 2 train.py --model resnet --dataset cifar10

The command is ``zoo.train.cli`` (installed as ``zoo-train``, which runs the same); the loop is
``zoo.train.loop.fit``. ``python train.py --help`` lists every key.
"""
import fire

from zoo.train.cli import command

main = command("train.py")

if __name__ == "__main__":
    fire.Fire(main)
