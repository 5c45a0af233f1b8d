// Browser scenarios of the JupyterLab extension, driven with Playwright in the system
// chromium. test_lab_ui.py starts the Jupyter server, runs one scenario per call:
//
//   node scenario.mjs <round-trip|not-snapshot-ready|save-fails>
//
// with LAB_URL (the server's base URL), LAB_TOKEN, NOTEBOOK (path relative to the
// server's root), ARTIFACTS (a folder for screenshots) in the environment. Every step
// takes a screenshot; the last line on stdout is a JSON object of what was seen, for
// the Python side to check. Any failed wait throws, exits 1 and leaves a screenshot.
import { chromium } from 'playwright-core';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const { LAB_URL, LAB_TOKEN, NOTEBOOK, ARTIFACTS } = process.env;
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const STEP_TIMEOUT = 60_000;
const scenario = process.argv[2];

const seen = { scenario, steps: [], console_errors: [] };
let page;
let shot = 0;

function log(message) {
  console.log(`[${scenario}] ${message}`);
}

async function screenshot(name) {
  shot += 1;
  const file = path.join(ARTIFACTS, `${scenario}-${String(shot).padStart(2, '0')}-${name}.png`);
  await page.screenshot({ path: file });
  seen.steps.push(name);
  log(`screenshot ${path.basename(file)}`);
}

// --- JupyterLab helpers -------------------------------------------------------------

// The notebook on show: with several open, the others stay in the page, hidden.
const CURRENT = '.jp-NotebookPanel:not(.lm-mod-hidden)';
const snapshotButton = () => page.locator(`${CURRENT} .jp-gpu-snapshot-button`);

async function buttonState(state) {
  await page.waitForSelector(`${CURRENT} .jp-gpu-snapshot-button[data-state="${state}"]`, {
    timeout: STEP_TIMEOUT
  });
}

async function buttonTooltip() {
  return snapshotButton().locator('[title]').first().getAttribute('title');
}

// Headless chromium draws no native tooltips: show the button's title in a box of the
// test's own for the screenshot, then take it away.
async function showTooltip() {
  await page.evaluate(() => {
    const button = document.querySelector(
      '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-gpu-snapshot-button [title]'
    );
    const box = button.getBoundingClientRect();
    const tip = document.createElement('div');
    tip.id = 'ui-test-tooltip';
    tip.textContent = `tooltip: ${button.getAttribute('title')}`;
    Object.assign(tip.style, {
      position: 'fixed', left: `${box.left}px`, top: `${box.bottom + 4}px`,
      maxWidth: '560px', padding: '4px 6px', zIndex: 10000, whiteSpace: 'pre-wrap',
      background: '#ffffe1', border: '1px solid #888', font: '12px sans-serif'
    });
    document.body.appendChild(tip);
  });
}

async function hideTooltip() {
  await page.evaluate(() => document.getElementById('ui-test-tooltip')?.remove());
}

async function toast(pattern) {
  const locator = page.locator('.Toastify__toast').filter({ hasText: pattern });
  await locator.first().waitFor({ state: 'visible', timeout: STEP_TIMEOUT });
  // Toasts slide in; the screenshot should show the whole of it.
  await locator
    .first()
    .evaluate(
      node =>
        new Promise(resolve => {
          const settled = () =>
            node.getBoundingClientRect().right <= window.innerWidth
              ? resolve()
              : requestAnimationFrame(settled);
          settled();
        })
    )
    .catch(() => undefined);
  return (await locator.first().innerText()).trim();
}

// Every text any notification shows, in order: progress updates are short-lived.
async function recordToasts() {
  await page.evaluate(TOAST_RECORDER);
}

const TOAST_RECORDER = () => {
  window.__toasts = [];
  const record = () => {
    for (const node of document.querySelectorAll('.Toastify__toast')) {
      const text = node.innerText.trim();
      if (text && window.__toasts[window.__toasts.length - 1] !== text) {
        window.__toasts.push(text);
      }
    }
  };
  new MutationObserver(record).observe(document.body, {
    subtree: true,
    childList: true,
    characterData: true
  });
};

async function recordedToasts() {
  return page.evaluate(() => window.__toasts);
}

async function runCell(index) {
  const cell = page.locator(`${CURRENT} .jp-Notebook .jp-Cell`).nth(index);
  await cell.locator('.jp-InputArea-prompt').click();
  await page.keyboard.press('Shift+Enter');
  const output = cell.locator('.jp-OutputArea-output');
  await output.first().waitFor({ state: 'visible', timeout: STEP_TIMEOUT });
  return (await output.allInnerTexts()).join('\n').trim();
}

async function openFromFileBrowser(notebook) {
  await page
    .locator('.jp-DirListing-item', { hasText: notebook })
    .first()
    .dblclick();
  await page
    .locator('.lm-TabBar-tab.lm-mod-current', { hasText: notebook })
    .waitFor({ timeout: STEP_TIMEOUT });
}

async function useTheme(name) {
  await page.keyboard.press('Control+Shift+C');
  await page.locator('.lm-CommandPalette-input').fill(`Use Theme: ${name}`);
  await page.locator('.lm-CommandPalette-item', { hasText: `Use Theme: ${name}` }).first().click();
  await page.waitForFunction(
    theme => document.body.dataset.jpThemeName === theme,
    name,
    { timeout: STEP_TIMEOUT }
  );
}

// WCAG contrast ratio of an element's text colour on its background.
async function contrast(locator) {
  return locator.evaluate(node => {
    const rgb = value => value.match(/[\d.]+/g).slice(0, 3).map(Number);
    const luminance = ([r, g, b]) => {
      const lin = c => ((c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4);
      return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
    };
    const style = getComputedStyle(node);
    const [a, b] = [luminance(rgb(style.color)), luminance(rgb(style.backgroundColor))];
    return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  });
}

async function kernelMenu(command) {
  await page.locator('.lm-MenuBar-item', { hasText: /^Kernel$/ }).click();
  const item = page.locator(`.lm-Menu-item[data-command="${command}"]`);
  await item.waitFor({ state: 'visible', timeout: STEP_TIMEOUT });
  return item;
}

async function api(endpoint, init = {}) {
  const response = await fetch(new URL(endpoint, LAB_URL), {
    ...init,
    headers: { Authorization: `token ${LAB_TOKEN}`, ...(init.headers || {}) }
  });
  const text = await response.text();
  return { status: response.status, body: text ? JSON.parse(text) : null };
}

async function notebookKernelId(notebook = NOTEBOOK) {
  const { body } = await api('api/sessions');
  const session = body.find(s => s.path === notebook);
  return session ? session.kernel.id : null;
}

async function openNotebook(notebook = NOTEBOOK) {
  const url = new URL(`lab/tree/${notebook}`, LAB_URL);
  url.searchParams.set('token', LAB_TOKEN);
  url.searchParams.set('reset', '');
  await page.goto(url.href);
  await page.locator('.jp-NotebookPanel .jp-Cell').first().waitFor({ timeout: STEP_TIMEOUT });
  log('notebook open');
}

// --- scenarios --------------------------------------------------------------------

const scenarios = {
  // Save a kernel with the toolbar button, shut it down, restore it from the dialog in
  // the Kernel menu, see its state, then delete the snapshot from the dialog.
  async 'round-trip'() {
    await openNotebook();
    await buttonState('ready');
    seen.ready_tooltip = await buttonTooltip();
    await showTooltip();
    await screenshot('kernel-ready');
    await hideTooltip();

    seen.state_output = await runCell(0);
    seen.kernel_before = await notebookKernelId();
    await screenshot('state-set');

    await recordToasts();
    await snapshotButton().locator('.jp-ToolbarButtonComponent').click();
    seen.saved_toast = await toast(/Snapshot saved/);
    seen.save_toasts = await recordedToasts();
    await screenshot('snapshot-saved');
    // A success notification closes by itself (it used to stay when the last progress
    // update, a full bar, came a few milliseconds before it).
    const savedAt = Date.now();
    seen.saved_toast_closed = await page
      .locator('.Toastify__toast', { hasText: 'Snapshot saved' })
      .waitFor({ state: 'detached', timeout: 20_000 })
      .then(() => (Date.now() - savedAt) / 1000)
      .catch(() => null);
    await screenshot('saved-toast-closed');
    await page.locator('.jp-gpu-snapshot-status', { hasText: /Snapshot (just now|.* ago)/ }).waitFor({
      timeout: STEP_TIMEOUT
    });
    seen.status_item = await page.locator('.jp-gpu-snapshot-status').innerText();
    await screenshot('status-bar-age');

    await (await kernelMenu('kernelmenu:shutdown')).click();
    await buttonState('disabled');
    seen.after_shutdown_tooltip = await buttonTooltip();
    seen.kernel_after_shutdown = await notebookKernelId();
    // The status item stays after the kernel is gone: the quickstart clicks it now.
    await page
      .locator('.jp-gpu-snapshot-status', { hasText: 'Snapshots' })
      .waitFor({ timeout: STEP_TIMEOUT });
    seen.status_after_shutdown = await page.locator('.jp-gpu-snapshot-status').innerText();
    await showTooltip();
    await screenshot('kernel-shut-down');
    await hideTooltip();

    const restoreItem = await kernelMenu('gpu-snapshot:restore');
    seen.kernel_menu = await page
      .locator('.lm-Menu-item[data-command^="gpu-snapshot:"]')
      .evaluateAll(items => items.map(i => i.innerText.trim()));
    await screenshot('kernel-menu');
    await restoreItem.click();
    const dialog = page.locator('.jp-Dialog');
    await dialog.locator('.jp-gpu-snapshot-table tr[data-snapshot-id]').first().waitFor({
      timeout: STEP_TIMEOUT
    });
    seen.dialog_rows = await dialog
      .locator('tr[data-snapshot-id]')
      .evaluateAll(rows => rows.map(r => r.getAttribute('data-snapshot-name')));
    seen.dialog_text = await dialog.locator('.jp-gpu-snapshot-picker').innerText();
    seen.dialog_selected = await dialog
      .locator('tr.jp-mod-selected')
      .evaluateAll(rows => rows.map(r => r.getAttribute('data-snapshot-name')));
    await screenshot('restore-dialog');
    await dialog.locator('.jp-mod-accept').click();
    seen.restored_toast = await toast(/Kernel restored/);
    seen.restore_toasts = await recordedToasts();
    await buttonState('ready');
    await screenshot('kernel-restored');

    seen.kernel_after_restore = await notebookKernelId();
    seen.after_restore_output = await runCell(1);
    await screenshot('state-after-restore');

    // The rest in the dark theme: the selected row and the badges must stay readable.
    await useTheme('JupyterLab Dark');
    await (await kernelMenu('gpu-snapshot:restore')).click();
    const row = dialog.locator('tr[data-snapshot-id]').first();
    await row.waitFor({ timeout: STEP_TIMEOUT });
    await row.click();
    seen.dark_selected_contrast = await contrast(row.locator('td').nth(1));
    await screenshot('restore-dialog-dark');
    await row.locator('.jp-gpu-snapshot-delete').click();
    await row.locator('.jp-gpu-snapshot-delete', { hasText: 'Confirm delete' }).waitFor();
    await screenshot('delete-confirm');
    await row.locator('.jp-gpu-snapshot-delete').click();
    await dialog
      .locator('.jp-gpu-snapshot-empty', { hasText: 'No snapshot of this notebook yet' })
      .waitFor({ timeout: STEP_TIMEOUT });
    await screenshot('snapshot-deleted');
    // Escape still closes the dialog after a delete took its button away.
    await page.keyboard.press('Escape');
    seen.escape_closed_dialog = await dialog
      .waitFor({ state: 'detached', timeout: 5000 })
      .then(() => true)
      .catch(() => false);
    if (!seen.escape_closed_dialog) {
      await dialog.locator('.jp-mod-reject').click();
    }
    await page
      .locator('.jp-gpu-snapshot-status', { hasText: 'No snapshot yet' })
      .waitFor({ timeout: STEP_TIMEOUT });
    seen.status_after_delete = await page.locator('.jp-gpu-snapshot-status').innerText();
    seen.snapshots_left = (await api('gpu-snapshot/snapshots')).body.snapshots.length;
  },

  // A notebook on the plain python3 kernel: the button stays disabled and says why.
  async 'not-snapshot-ready'() {
    await openNotebook();
    await page.waitForFunction(
      () => {
        const node = document.querySelector('.jp-gpu-snapshot-button');
        const title = node?.querySelector('[title]')?.getAttribute('title') || '';
        return node?.dataset.state === 'disabled' && title.startsWith('Snapshots unavailable');
      },
      null,
      { timeout: STEP_TIMEOUT }
    );
    seen.disabled_tooltip = await buttonTooltip();
    seen.kernel = await notebookKernelId();
    await showTooltip();
    await screenshot('button-disabled');
    await hideTooltip();
    // The palette entry is disabled too.
    await page.keyboard.press('Control+Shift+C');
    await page.locator('.lm-CommandPalette-input').fill('Snapshot kernel');
    const entry = page.locator('.lm-CommandPalette-item', { hasText: 'Snapshot kernel' });
    // JupyterLab keeps disabled commands in the palette's DOM but does not show them.
    await entry.first().waitFor({ state: 'attached', timeout: STEP_TIMEOUT });
    seen.palette_disabled = await entry
      .first()
      .evaluate(node => node.classList.contains('lm-mod-disabled'));
    await screenshot('palette-entry-disabled');
    await page.keyboard.press('Escape');
    // Clicking the greyed-out button explains and offers to switch the kernel.
    await snapshotButton().locator('.jp-ToolbarButtonComponent').click();
    seen.explanation = await toast(/Snapshots need/);
    await screenshot('button-click-explains');
    await page
      .locator('.Toastify__toast', { hasText: 'Snapshots need' })
      .getByRole('button', { name: 'Change kernel…' })
      .click();
    const picker = page.locator('.jp-Dialog');
    await picker.waitFor({ timeout: STEP_TIMEOUT });
    seen.change_kernel_dialog = (await picker.locator('.jp-Dialog-header').innerText()).trim();
    await screenshot('change-kernel-dialog');
    await picker.locator('.jp-mod-reject').first().click();
  },

  // criu fails while dumping: an error notification names the step and the cause, and
  // the kernel goes on answering.
  async 'save-fails'() {
    await openNotebook();
    await buttonState('ready');
    seen.state_output = await runCell(0);
    await snapshotButton().locator('.jp-ToolbarButtonComponent').click();
    seen.error_toast = await toast(/Snapshot failed/);
    await screenshot('snapshot-failed');
    await page
      .locator('.Toastify__toast', { hasText: 'Snapshot failed' })
      .getByRole('button', { name: 'Details' })
      .click();
    const details = page.locator('.jp-Dialog');
    await details.waitFor({ timeout: STEP_TIMEOUT });
    seen.error_details = (await details.locator('.jp-Dialog-body').innerText()).trim();
    await screenshot('error-details');
    await details.locator('.jp-mod-accept, .jp-mod-reject').first().click();
    await buttonState('ready');
    seen.after_failure_output = await runCell(1);
    await screenshot('kernel-still-alive');
    seen.snapshots_left = (await api('gpu-snapshot/snapshots')).body.snapshots.length;
  }
};

// Going back to an earlier snapshot of the kernel that still runs: the restore is refused
// (the ports are taken) and the error offers to shut that kernel down first.
scenarios['restore-over-running-kernel'] = async () => {
  await openNotebook();
  await buttonState('ready');
  seen.state_output = await runCell(0);
  await snapshotButton().locator('.jp-ToolbarButtonComponent').click();
  await toast(/Snapshot saved/);
  await buttonState('ready');
  seen.changed_output = await runCell(2);
  seen.kernel_before = await notebookKernelId();

  await (await kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog');
  const row = dialog.locator('tr[data-snapshot-id]').first();
  await row.waitFor({ timeout: STEP_TIMEOUT });
  // The snapshot of the running kernel is marked and not pre-selected.
  seen.row_text = (await row.innerText()).trim();
  seen.preselected = await dialog.locator('tr.jp-mod-selected').count();
  await screenshot('dialog-marks-this-kernel');
  // The arrow keys move the selection.
  await dialog.locator('.jp-gpu-snapshot-picker').focus();
  await page.keyboard.press('ArrowDown');
  seen.selected_by_arrow = await dialog
    .locator('tr.jp-mod-selected')
    .evaluateAll(rows => rows.map(r => r.getAttribute('data-snapshot-id')));
  seen.first_row = await row.getAttribute('data-snapshot-id');
  await dialog.locator('.jp-mod-accept').click();
  seen.refused_toast = await toast(/Restore of .* failed/);
  await screenshot('restore-refused');
  const refused = page.locator('.Toastify__toast', { hasText: 'failed' });
  // Details leaves the notification, and its remedy, in place; the dialog offers it too.
  await refused.getByRole('button', { name: 'Details' }).click();
  const details = page.locator('.jp-Dialog');
  await details.waitFor({ timeout: STEP_TIMEOUT });
  seen.details_text = (await details.locator('.jp-Dialog-body').innerText()).trim();
  seen.details_buttons = await details
    .locator('.jp-Dialog-footer button')
    .evaluateAll(buttons => buttons.map(b => b.innerText.trim()));
  await screenshot('refused-details');
  await details.getByRole('button', { name: 'Close' }).click();
  await details.waitFor({ state: 'detached', timeout: STEP_TIMEOUT });
  seen.toast_after_details = await refused.count();
  await refused.getByRole('button', { name: 'Shut down this kernel and restore' }).click();
  seen.restored_toast = await toast(/Kernel restored/);
  await buttonState('ready');
  seen.kernel_after_restore = await notebookKernelId();
  seen.after_restore_output = await runCell(1);
  await screenshot('state-after-restore');
  seen.kernels = (await api('api/kernels')).body.map(k => k.id);
};

// Notebook A's snapshot restored from notebook B while A's kernel still runs: the refusal
// names A's kernel, offers to shut down that one, and B's kernel is not touched before the
// restore replaces it.
scenarios['restore-from-other-notebook'] = async () => {
  const other = process.env.OTHER_NOTEBOOK;
  await openNotebook(other);
  await buttonState('ready');
  seen.other_state = await runCell(0);
  await snapshotButton().locator('.jp-ToolbarButtonComponent').click();
  await toast(/Snapshot saved/);
  seen.other_kernel = await notebookKernelId(other);
  const saved = (await api('gpu-snapshot/snapshots')).body.snapshots;
  seen.snapshot_name = saved[0].name;

  await openNotebook();
  await buttonState('ready');
  seen.kernel_before = await notebookKernelId();
  await (await kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog');
  const row = dialog.locator(`tr[data-snapshot-name="${seen.snapshot_name}"]`);
  await row.waitFor({ timeout: STEP_TIMEOUT });
  await row.click();
  await screenshot('dialog-other-notebook-snapshot');
  await dialog.locator('.jp-mod-accept').click();
  seen.refused_toast = await toast(/Restore of .* failed/);
  // The progress notification went with the outcome; it used to come back beside it.
  await page.waitForTimeout(1500);
  seen.progress_toasts_left = await page
    .locator('.Toastify__toast', { hasText: /Restoring '[^']*'(…|:)/ })
    .count();
  await screenshot('refused-names-other-notebook');
  const refused = page.locator('.Toastify__toast', { hasText: 'failed' });
  seen.refused_buttons = await refused
    .getByRole('button')
    .evaluateAll(buttons => buttons.map(b => b.innerText.trim()).filter(Boolean));
  seen.kernels_after_refusal = (await api('api/kernels')).body.map(k => k.id).sort();
  seen.kernel_after_refusal = await notebookKernelId();

  await refused.getByRole('button', { name: /^Shut down .* kernel and restore$/ }).click();
  seen.restored_toast = await toast(/Kernel restored/);
  await buttonState('ready');
  seen.kernel_after_restore = await notebookKernelId();
  seen.other_kernel_after_restore = await notebookKernelId(other);
  seen.after_restore_output = await runCell(1);
  await screenshot('restored-into-this-notebook');
  seen.kernels = (await api('api/kernels')).body.map(k => k.id);
};

// The Snapshots sidebar: a snapshot named at save time (shift-click) shows there with its
// facts; search and sort; restore and delete from it; light and dark themes.
scenarios['sidebar'] = async () => {
  await openNotebook();
  await buttonState('ready');
  seen.state_output = await runCell(0);
  await snapshotButton().locator('.jp-ToolbarButtonComponent').click({ modifiers: ['Shift'] });
  const naming = page.locator('.jp-Dialog');
  await naming.locator('input').fill('sidebar-one');
  await screenshot('name-at-save');
  await naming.locator('.jp-mod-accept').click();
  seen.saved_toast = await toast(/Snapshot saved: 'sidebar-one'/);
  await buttonState('ready');

  await page.locator('.lm-TabBar-tab[data-id="jp-gpu-snapshot-sidebar"]').click();
  const sidebar = page.locator('#jp-gpu-snapshot-sidebar');
  const item = sidebar.locator('[data-section="own"] [data-snapshot-name="sidebar-one"]');
  await item.waitFor({ timeout: STEP_TIMEOUT });
  await sidebar.locator('.jp-gpu-snapshot-store', { hasText: 'free' }).waitFor();
  seen.store_text = (await sidebar.locator('.jp-gpu-snapshot-store').innerText()).trim();
  seen.item_text = (await item.innerText()).trim();
  await screenshot('sidebar-light');

  await sidebar.locator('.jp-gpu-snapshot-search').fill('no-such-thing');
  seen.search_empty = await sidebar.locator('.jp-gpu-snapshot-empty').allInnerTexts();
  await sidebar.locator('.jp-gpu-snapshot-search').fill('sidebar');
  seen.search_hits = await sidebar
    .locator('[data-snapshot-name]')
    .evaluateAll(items => items.map(i => i.getAttribute('data-snapshot-name')));
  await sidebar.locator('.jp-gpu-snapshot-search').fill('');
  await sidebar.locator('.jp-gpu-snapshot-sort').selectOption('size');

  await useTheme('JupyterLab Dark');
  await item.waitFor();
  seen.dark_name_contrast = await contrast(item.locator('.jp-gpu-snapshot-name'));
  await screenshot('sidebar-dark');

  await (await kernelMenu('kernelmenu:shutdown')).click();
  await buttonState('disabled');
  await item.locator('.jp-gpu-snapshot-restore').click();
  seen.restored_toast = await toast(/Kernel restored from 'sidebar-one'/);
  await buttonState('ready');
  seen.after_restore_output = await runCell(1);
  await screenshot('restored-from-sidebar');

  // Rename: the server re-signs the manifest; a taken or invalid name is said inline.
  await item.locator('.jp-gpu-snapshot-rename').click();
  const ask = page.locator('.jp-Dialog');
  await ask.locator('input').fill('bad/name');
  await ask.locator('.jp-mod-accept').click();
  const error = sidebar.locator('.jp-gpu-snapshot-error');
  await error.waitFor({ timeout: STEP_TIMEOUT });
  seen.rename_error = (await error.innerText()).trim();
  await item.locator('.jp-gpu-snapshot-rename').click();
  await ask.locator('input').fill('sidebar-renamed');
  await screenshot('rename');
  await ask.locator('.jp-mod-accept').click();
  const renamed = sidebar.locator('[data-section="own"] [data-snapshot-name="sidebar-renamed"]');
  await renamed.waitFor({ timeout: STEP_TIMEOUT });
  seen.renamed_names = (await api('gpu-snapshot/snapshots')).body.snapshots.map(s => s.name);
  seen.error_after_rename = await error.count();
  await screenshot('renamed-in-sidebar');

  await renamed.locator('.jp-gpu-snapshot-delete').click();
  await renamed.locator('.jp-gpu-snapshot-delete', { hasText: 'Confirm delete' }).click();
  await renamed.waitFor({ state: 'detached', timeout: STEP_TIMEOUT });
  seen.snapshots_left = (await api('gpu-snapshot/snapshots')).body.snapshots.length;
  await screenshot('deleted-from-sidebar');
};

// The snapshot panel widget (%gpu_snapshot widget) lives in the kernel's memory: after the
// notebook moves to a restored kernel, its output shows the restored widget, live, not
// "model not found"; the same after the page is reloaded while no kernel holds the widget.
scenarios['widget-after-restore'] = async () => {
  const widgetOutput = () =>
    page.locator(`${CURRENT} .jp-Notebook .jp-Cell`).nth(3).locator('.jp-OutputArea-output');
  const widgetText = async () => (await widgetOutput().allInnerTexts()).join('\n');
  const panelShows = async pattern =>
    widgetOutput().filter({ hasText: pattern }).first().waitFor({ timeout: STEP_TIMEOUT });
  await openNotebook();
  await buttonState('ready');
  seen.state_output = await runCell(0);
  await runCell(3);
  await panelShows(/This notebook's snapshots/);
  await screenshot('widget-shown');
  await snapshotButton().locator('.jp-ToolbarButtonComponent').click();
  await toast(/Snapshot saved/);
  await buttonState('ready');
  await panelShows(/Last snapshot/);
  await page.keyboard.press('Control+s');
  await page.locator('.lm-TabBar-tab.jp-mod-dirty').waitFor({
    state: 'detached',
    timeout: STEP_TIMEOUT
  });
  seen.snapshot_name = (await api('gpu-snapshot/snapshots')).body.snapshots[0].name;

  // Reopened while its kernel is gone: JupyterLab cannot show the widget (no kernel holds
  // it); after the restore the notebook's output shows the restored one.
  await (await kernelMenu('kernelmenu:shutdown')).click();
  await buttonState('disabled');
  await openNotebook();
  await buttonState('ready');
  // The fresh kernel JupyterLab started holds no widget.
  await panelShows(/model not found/).catch(() => undefined);
  seen.widget_before_restore = await widgetText();
  await screenshot('reopened-without-kernel');
  // That is JupyterLab's own console error; what follows the restore must be clean.
  seen.errors_before_restore = seen.console_errors.splice(0);
  await (await kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog');
  await dialog.locator('tr[data-snapshot-id]').first().waitFor({ timeout: STEP_TIMEOUT });
  await dialog.locator('.jp-mod-accept').click();
  await toast(/Kernel restored/);
  await buttonState('ready');
  seen.widget_after_restore = await panelShows(seen.snapshot_name)
    .then(widgetText)
    .catch(widgetText);
  await screenshot('widget-after-restore');
  // The restored widget is live: its Save button saves the restored kernel.
  await widgetOutput().locator('input').first().fill('from-widget');
  await widgetOutput().locator('button', { hasText: 'Save' }).click();
  await panelShows(/from-widget/).catch(() => undefined);
  seen.widget_after_save = await widgetText();
  await screenshot('widget-live-after-restore');
  seen.after_restore_output = await runCell(1);

  // Without a reload: the kernel shut down from the menu, the same snapshot restored. The
  // page still holds the models of the kernel before; the restored kernel's must replace
  // them, or the panel is a dead copy.
  await (await kernelMenu('kernelmenu:shutdown')).click();
  await buttonState('disabled');
  await (await kernelMenu('gpu-snapshot:restore')).click();
  const again = dialog.locator(`tr[data-snapshot-name="${seen.snapshot_name}"]`);
  await again.waitFor({ timeout: STEP_TIMEOUT });
  await again.click();
  await dialog.locator('.jp-mod-accept').click();
  await toast(/Kernel restored/);
  await buttonState('ready');
  await widgetOutput().locator('input').first().fill('same-page');
  await widgetOutput().locator('button', { hasText: 'Save' }).click();
  await panelShows(/same-page/).catch(() => undefined);
  seen.widget_after_second_restore = await widgetText();
  await screenshot('widget-live-after-second-restore');
  seen.snapshots = (await api('gpu-snapshot/snapshots')).body.snapshots.map(s => s.name).sort();
};

// Autosave (the server's interval set to seconds by the test): the status bar says
// "Autosaving…", then "Autosaved … (paused …)"; the sidebar shows the notebook's policy and
// the next autosave, and overrides it for this notebook (off, then on every 30 min).
scenarios['autosave'] = async () => {
  await openNotebook();
  await buttonState('ready');
  await page.evaluate(() => {
    window.__statusTexts = [];
    const record = () => {
      const text = document.querySelector('.jp-gpu-snapshot-status')?.textContent ?? '';
      if (text && window.__statusTexts[window.__statusTexts.length - 1] !== text) {
        window.__statusTexts.push(text);
      }
    };
    new MutationObserver(record).observe(document.body, {
      subtree: true,
      childList: true,
      characterData: true
    });
  });
  seen.state_output = await runCell(0);
  const status = page.locator('.jp-gpu-snapshot-status', { hasText: /^Autosaved / });
  await status.waitFor({ timeout: 90_000 });
  seen.status_item = (await status.innerText()).trim();
  seen.status_texts = await page.evaluate(() => window.__statusTexts);
  await screenshot('autosave-status');

  await page.locator('.lm-TabBar-tab[data-id="jp-gpu-snapshot-sidebar"]').click();
  const section = page.locator('#jp-gpu-snapshot-sidebar [data-section="autosave"]');
  await section.locator('.jp-gpu-snapshot-autosave-last').waitFor({ timeout: STEP_TIMEOUT });
  seen.sidebar_policy = (await section.locator('.jp-gpu-snapshot-autosave-policy').innerText()).trim();
  seen.sidebar_last = (await section.locator('.jp-gpu-snapshot-autosave-last').innerText()).trim();
  seen.sidebar_next = (await section.locator('.jp-gpu-snapshot-autosave-next').innerText()).trim();
  await screenshot('sidebar-autosave');

  const kernel = await notebookKernelId();
  await section.locator('.jp-gpu-snapshot-autosave-mode').selectOption('off');
  await section.getByRole('button', { name: 'Apply' }).click();
  await section
    .locator('.jp-gpu-snapshot-autosave-policy', { hasText: /^off/ })
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.policy_off = (await section.locator('.jp-gpu-snapshot-autosave-policy').innerText()).trim();
  seen.server_off = (await api(`gpu-snapshot/kernels/${kernel}/autosave`)).body.policy;

  await section.locator('.jp-gpu-snapshot-autosave-mode').selectOption('on');
  await section.locator('.jp-gpu-snapshot-autosave-interval').fill('30');
  await section.getByRole('button', { name: 'Apply' }).click();
  await section
    .locator('.jp-gpu-snapshot-autosave-policy', { hasText: /^every 30 min/ })
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.policy_on = (await section.locator('.jp-gpu-snapshot-autosave-policy').innerText()).trim();
  seen.server_on = (await api(`gpu-snapshot/kernels/${kernel}/autosave`)).body;
  await screenshot('sidebar-autosave-overridden');

  // A server says where each snapshot is kept (location): the sidebar and the dialog show
  // it. This server has no remote store; its answers say "remote" here, so that the words
  // for a remote-only snapshot show once the sidebar has asked again.
  await page.route(/gpu-snapshot\/snapshots(\?|$)/, async route => {
    const response = await route.fetch();
    const listing = await response.json();
    listing.snapshots.forEach(s => (s.location = 'remote'));
    await route.fulfill({ response, json: listing });
  });
  await section.locator('.jp-gpu-snapshot-autosave-mode').selectOption('default');
  await section.getByRole('button', { name: 'Apply' }).click();
  await section
    .locator('.jp-gpu-snapshot-autosave-policy', { hasText: /the server's setting/ })
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.server_default = (await api(`gpu-snapshot/kernels/${kernel}/autosave`)).body.override;
  const where = page
    .locator('#jp-gpu-snapshot-sidebar .jp-gpu-snapshot-location[data-location="remote"]')
    .first();
  await where.waitFor({ timeout: STEP_TIMEOUT });
  seen.sidebar_location = (await where.innerText()).trim();
  await (await kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog');
  const badge = dialog.locator('.jp-gpu-snapshot-location[data-location="remote"]').first();
  await badge.waitFor({ timeout: STEP_TIMEOUT });
  seen.dialog_location = (await badge.innerText()).trim();
  await screenshot('location-in-dialog');
  await page.keyboard.press('Escape');
};

// --- after a server restart (two runs of this script, the server stopped between) ---

scenarios['before-shutdown'] = async () => {
  await openNotebook();
  await buttonState('ready');
  seen.state_output = await runCell(0);
  seen.kernel_before = await notebookKernelId();
  // Saved with the notebook, so the outputs are there again after the restart.
  await page.keyboard.press('Control+s');
  await page.locator('.lm-TabBar-tab.jp-mod-dirty').waitFor({
    state: 'detached',
    timeout: STEP_TIMEOUT
  });
  await screenshot('state-set');
  // A second notebook with a kernel of its own: saved at shutdown too.
  await openFromFileBrowser(process.env.OTHER_NOTEBOOK);
  await page
    .locator(`${CURRENT} .jp-gpu-snapshot-button[data-state="ready"]`)
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.other_kernel = await notebookKernelId(process.env.OTHER_NOTEBOOK);
  // A kernel that has run nothing is not saved at shutdown: give this one some work.
  seen.other_output = await runCell(0);
  // Saved by hand after its work: the shutdown leaves it alone, and the restart offers
  // this snapshot, reason and all.
  await snapshotButton().locator('.jp-ToolbarButtonComponent').click();
  await toast(/Snapshot saved/);
  await buttonState('ready');
  await screenshot('second-notebook-open');
};

scenarios['after-restart'] = async () => {
  await openNotebook();
  seen.offer = await toast(/Restore the kernel of .*\? Its newest snapshot:/);
  // The notebook started a fresh kernel meanwhile; the restore replaces it.
  await buttonState('ready');
  await page
    .locator('.jp-StatusBar-Widget', { hasText: /Python 3 \(snapshots\) \| Idle/ })
    .first()
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.fresh_kernel = await notebookKernelId();
  await screenshot('restore-offered');
  // A second notebook opens: one offer names both, not two identical ones.
  await openFromFileBrowser(process.env.OTHER_NOTEBOOK);
  seen.merged_offer = await toast(/Restore the kernels of 2 notebooks/);
  seen.offer_count = await page
    .locator('.Toastify__toast', { hasText: /Restore the kernels? of/ })
    .count();
  await screenshot('restart-offer-names-both');
  const offer = page.locator('.Toastify__toast', { hasText: /Restore the kernels of/ });
  await offer.getByRole('button', { name: 'Restore all' }).click();
  await page
    .locator('.Toastify__toast', { hasText: /Kernel restored/ })
    .nth(1)
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.restored_toasts = await page
    .locator('.Toastify__toast', { hasText: /Kernel restored/ })
    .allInnerTexts();
  seen.restored_toast = seen.restored_toasts[0];
  await page.locator('.lm-TabBar-tab', { hasText: NOTEBOOK }).click();
  await buttonState('ready');
  seen.kernel_after_restore = await notebookKernelId();
  await screenshot('kernel-restored');
  seen.after_restore_output = await runCell(1);
  await screenshot('state-after-restore');
  seen.sessions = (await api('api/sessions')).body.map(s => [s.path, s.kernel.id]).sort();
  seen.kernels = (await api('api/kernels')).body.map(k => k.id).sort();
};

// --- main ---------------------------------------------------------------------------

async function main() {
  if (!scenarios[scenario]) {
    throw new Error(`unknown scenario ${scenario}; one of ${Object.keys(scenarios).join(', ')}`);
  }
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'jgs-chromium-'));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1366, height: 820 },
    args: [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync'
    ]
  });
  page = context.pages()[0] ?? (await context.newPage());
  page.on('console', message => {
    // JupyterLab's debugger logs this when a kernel it is asking about is shut down, as
    // the port-holder remedy does on purpose; any other error fails the scenario.
    const debuggerRace = /^Could not restore the debugger state: Canceled future/;
    if (message.type() === 'error' && !debuggerRace.test(message.text())) {
      seen.console_errors.push(message.text().slice(0, 500));
    }
  });
  page.on('pageerror', error => seen.console_errors.push(String(error).slice(0, 500)));
  let failed = null;
  try {
    await scenarios[scenario]();
  } catch (error) {
    failed = error;
    seen.error = String(error.stack || error);
    await screenshot('FAILED').catch(() => undefined);
  } finally {
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
  console.log(JSON.stringify(seen));
  if (failed) {
    process.exitCode = 1;
  }
}

await main();
