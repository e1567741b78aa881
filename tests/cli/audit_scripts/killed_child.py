"""A child process that ends before anything of it is recorded (audit fixture): whatever it
trained, the audit cannot say; it must not say that nothing trained."""

import multiprocessing as mp
import os
import signal

import torch


def train() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)
    child = mp.get_context("fork").Process(target=train)
    child.start()
    child.join()
