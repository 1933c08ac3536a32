"""Accuracy on real CIFAR-10 (`make test-slow`): the Keras recipe must match the Keras pipeline."""

import os

import pytest

from configs import cifar10
from conftest import CIFAR10
from flaxtpu import train

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir(CIFAR10), reason=f'needs {CIFAR10}')]

KERAS_TEST_ACCURACY = 0.422  # the Keras pipeline on this copy (../shared/datasets/README.md)


def test_keras_recipe_reaches_the_keras_accuracy(tmp_path):
  config = cifar10.get_config()  # the CNN, Adam 1e-3, batch 128, 5 epochs, no augmentation
  config.dataset.folder = CIFAR10
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results['step'] == 1950
  assert results['eval_accuracy'] >= KERAS_TEST_ACCURACY, results
  assert results['eval_loss'] <= 1.60, results
