"""Where the PS synchronizer sums a node's gradients: what crosses the network."""
import pytest
import tensorflow as tf

from autodist.kernels.context import KernelContext
from autodist.kernels.ps_synchronizer import node_contribution
from autodist.strategy import common

CHIEF, WORKER = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
DEVICES = {"10.0.0.1:CPU:0": CHIEF, "10.0.0.2:CPU:0": WORKER,
           "10.0.0.2:CPU:1": "/job:worker/task:1/device:CPU:1"}
# The worker's view of a cluster: the chief with one replica, the worker with two.
WORKER_CONTEXT = KernelContext(replica_devices=("10.0.0.2:CPU:0", "10.0.0.2:CPU:1"),
                               tf_devices=DEVICES, shared_device=WORKER, chief_device=CHIEF,
                               node_index=1, num_nodes=2, group_size=3, has_ps=True)


def _contribution(transfer_destination: str) -> tf.Tensor:
    sync = common.ps_node_config("w", "10.0.0.1:CPU:0",
                                 transfer_destination=transfer_destination).PSSynchronizer
    with tf.Graph().as_default():
        grads = [tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])]
        return node_contribution(grads, sync, WORKER_CONTEXT)


def test_without_a_transfer_destination_the_server_sums_every_replicas_gradient():
    assert _contribution("").device == CHIEF


@pytest.mark.parametrize("named", ["10.0.0.1:CPU:0", "10.0.0.2:CPU:0"])
def test_with_a_transfer_destination_each_node_sums_on_its_own_cpu(named):
    # Whatever device is named, the worker's two gradients leave it as one sum.
    summed = _contribution(named)
    assert summed.device == WORKER
    assert summed.op.type == "Mul" and summed.op.inputs[0].op.type == "AddN"
    assert summed.op.inputs[0].device == WORKER
