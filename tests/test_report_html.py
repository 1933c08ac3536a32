"""report.html: one self-contained page per evaluation, checked in a real headless Chromium (Debian's
chromium + chromium-driver, driven by selenium; .ci/run installs them, and the browser test skips
saying what is missing where they are absent)."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from flaxtpu.report import html, writer


@pytest.fixture(scope='module')
def report_page(tmp_path_factory):
  """An evaluation's page, made of generated logits with every section filled: config.json,
  metrics.jsonl, images for mistakes.png, a calibration record and an audit.json of the issue's schema."""
  directory = tmp_path_factory.mktemp('report')
  rng = np.random.default_rng(0)
  classes = ['cat', 'dog', 'frog', 'deer <&>']  # a name that must be escaped
  labels = rng.integers(0, 4, 120)
  logits = rng.normal(0, 1, (120, 4)) + 3 * np.eye(4)[labels]
  images = rng.integers(0, 255, (120, 16, 16, 3)).astype(np.uint8)
  (directory / 'config.json').write_text(json.dumps({
      'task': 'multiclass', 'model': {'name': 'cnn'}, 'dataset': {'name': 'digits', 'eval_split': 'test'},
      'batch_size': 32, 'optimizer': {'name': 'adam', 'learning_rate': 0.003}}))
  (directory / 'metrics.jsonl').write_text(''.join(
      json.dumps({'step': step, 'train_loss': 2.0 / step, 'eval_accuracy': 1 - 1 / step,
                  'learning_rate': 0.003}) + '\n' for step in range(1, 6)))
  (directory / 'audit.json').write_text(json.dumps({
      'exact_duplicates': [['train/cat/1.png', 'train/cat/2.png']], 'near_duplicates': [],
      'leaks': [['train/dog/3.png', 'test/dog/9.png']], 'unreadable': ['train/frog/broken.png'],
      'suspected_mislabels': [{'path': 'train/cat/7.png', 'label': 'cat', 'predicted': 'dog', 'score': 0.97}],
      'class_counts': {'cat': 30, 'dog': 30, 'frog': 30, 'deer <&>': 30}}))
  fitted = {'temperature': 1.7, 'coverage': 0.9, 'set_threshold': 0.93, 'set_score': 'aps', 'randomize': True,
            'raps_lambda': 0.0, 'raps_k': 1, 'seed': 0}
  summary = writer.write_eval_report(str(directory), logits / 1.7, labels, classes, images=images,
                                     calibration=fitted)
  return directory, summary


def test_report_page_is_one_self_contained_file_with_every_section(report_page):
  directory, summary = report_page
  assert summary['report_files'][-1] == 'report.html'
  page = (directory / 'report.html').read_text(encoding='utf-8')
  for ident in html.SECTIONS:
    assert f'<section id="{ident}">' in page, ident
  # Pictures inlined (curves, confusion, mistakes, reliability, set sizes); nothing fetched from anywhere.
  assert page.count('<img src="data:image/png;base64,') == 5
  assert not re.search(r'(src|href)="(?!data:|#)', page) and '<script' not in page and '<link' not in page
  assert 'deer &lt;&amp;&gt;' in page and 'deer <&>' not in page
  assert 'ECE before calibration' in page and f'{summary["eval_ece_uncalibrated"]:.4g}' in page
  assert 'train/dog/3.png | test/dog/9.png' in page and '<td>train/cat/7.png</td>' in page
  assert '<td>optimizer.learning_rate</td><td>0.003</td>' in page


def _browser():
  """A headless Chromium under selenium, or a skip that says what is missing."""
  try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
  except ImportError:
    pytest.skip("selenium is not installed (pip install 'flaxtpu[test]')")
  browser, driver = shutil.which('chromium'), shutil.which('chromedriver')
  if not (browser and driver):
    pytest.skip('no chromium/chromedriver: apt-get install chromium chromium-driver (see .ci/run)')
  options = webdriver.ChromeOptions()
  options.binary_location = browser
  for argument in ('--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
                   '--window-size=1200,900'):
    options.add_argument(argument)
  options.set_capability('goog:loggingPrefs', {'browser': 'ALL'})
  return webdriver.Chrome(options=options, service=Service(driver))


def test_report_page_renders_in_a_headless_browser(report_page, tmp_path):
  from selenium.webdriver.common.by import By
  directory, _ = report_page
  driver = _browser()
  try:
    driver.get((directory / 'report.html').as_uri())
    for ident in html.SECTIONS:
      section = driver.find_element(By.ID, ident)
      assert section.is_displayed() and section.size['height'] > 20, ident
    widths = driver.execute_script(
        'return Array.from(document.images).map(i => i.complete ? i.naturalWidth : -1)')
    assert len(widths) == 5 and all(width > 0 for width in widths), widths
    height = driver.execute_script('return document.body.scrollHeight')
    driver.set_window_size(1200, height + 300)  # the window's own bars take some of it
    screenshot = tmp_path / 'report.png'
    assert driver.save_screenshot(str(screenshot))
    from PIL import Image
    with Image.open(screenshot) as image:
      assert image.width >= 1000 and image.height >= 2000  # the whole page, every picture in it
      assert len(set(image.convert('L').getdata())) > 50  # pictures, not a blank page
    errors = [entry for entry in driver.get_log('browser') if entry['level'] == 'SEVERE']
    assert errors == []
  finally:
    driver.quit()
  assert os.path.getsize(screenshot) > 10_000
