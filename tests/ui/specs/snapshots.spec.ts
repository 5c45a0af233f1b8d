// Browser scenarios of the JupyterLab extension, one test per scenario, titled by its name.
// test_lab_ui.py starts the server with the scenario's notebooks, runs one of them
// (`playwright test --grep`), and checks what the scenario saw (seen.json) against the
// server's own state. Every step leaves a screenshot in ARTIFACTS/<scenario>/.
import type { Locator } from '@playwright/test';
import {
  CURRENT,
  expect,
  NOTEBOOK,
  OTHER_NOTEBOOK,
  STEP_TIMEOUT,
  test
} from './fixtures';

// Save a kernel with the toolbar button, shut it down, restore it from the dialog in the
// Kernel menu, see its state, then delete the snapshot from the dialog in the dark theme.
test('round-trip', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.ready_tooltip = await lab.buttonTooltip();
  await lab.showTooltip();
  await lab.screenshot('kernel-ready');
  await lab.hideTooltip();

  seen.state_output = await lab.runCell(0);
  seen.kernel_before = await lab.kernelOf();
  await lab.screenshot('state-set');

  await lab.recordToasts();
  await lab.clickSnapshot();
  seen.saved_toast = await lab.toast(/Snapshot saved/);
  seen.save_toasts = await lab.recordedToasts();
  await lab.screenshot('snapshot-saved');
  // A success notification closes by itself (it used to stay when the last progress
  // update, a full bar, came a few milliseconds before it).
  const savedAt = Date.now();
  seen.saved_toast_closed = await lab
    .toasts('Snapshot saved')
    .waitFor({ state: 'detached', timeout: 20_000 })
    .then(() => (Date.now() - savedAt) / 1000)
    .catch(() => null);
  await lab.screenshot('saved-toast-closed');
  const status = page.locator('.jp-gpu-snapshot-status');
  await expect(status).toHaveText(/Snapshot (just now|.* ago)/);
  seen.status_item = await status.innerText();
  await lab.screenshot('status-bar-age');

  await lab.shutDownKernel();
  // The button follows the session as the shutdown lands: wait for it to settle rather
  // than read it mid-change (on a busy machine a status answer for the ending kernel can
  // come first). A tooltip that never settles is reported as it stands.
  await expect
    .poll(() => lab.buttonTooltip(), { timeout: 30_000 })
    .toBe('No kernel is running in this notebook')
    .catch(() => undefined);
  seen.after_shutdown_tooltip = await lab.buttonTooltip();
  seen.kernel_after_shutdown = await lab.kernelOf();
  // The status item stays after the kernel is gone: the quickstart clicks it now.
  await expect(status).toHaveText('Snapshots');
  seen.status_after_shutdown = await status.innerText();
  await lab.showTooltip();
  await lab.screenshot('kernel-shut-down');
  await lab.hideTooltip();

  const restoreItem = await lab.kernelMenu('gpu-snapshot:restore');
  seen.kernel_menu = await page
    .locator('.lm-Menu-item[data-command^="gpu-snapshot:"]')
    .evaluateAll(items => items.map(i => (i as HTMLElement).innerText.trim()));
  await lab.screenshot('kernel-menu');
  await restoreItem.click();
  const dialog = page.locator('.jp-Dialog');
  await dialog
    .locator('.jp-gpu-snapshot-table tr[data-snapshot-id]')
    .first()
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.dialog_rows = await dialog
    .locator('tr[data-snapshot-id]')
    .evaluateAll(rows => rows.map(r => r.getAttribute('data-snapshot-name')));
  seen.dialog_text = await dialog.locator('.jp-gpu-snapshot-picker').innerText();
  seen.dialog_selected = await dialog
    .locator('tr.jp-mod-selected')
    .evaluateAll(rows => rows.map(r => r.getAttribute('data-snapshot-name')));
  await lab.screenshot('restore-dialog');
  await dialog.locator('.jp-mod-accept').click();
  seen.restored_toast = await lab.toast(/Kernel restored/);
  seen.restore_toasts = await lab.recordedToasts();
  await lab.buttonState('ready');
  await lab.screenshot('kernel-restored');

  seen.kernel_after_restore = await lab.kernelOf();
  seen.after_restore_output = await lab.runCell(1);
  await lab.screenshot('state-after-restore');

  // The rest in the dark theme: the selected row and the badges must stay readable.
  await lab.darkTheme();
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  const row = dialog.locator('tr[data-snapshot-id]').first();
  await row.waitFor({ timeout: STEP_TIMEOUT });
  await row.click();
  seen.dark_selected_contrast = await lab.contrast(row.locator('td').nth(1));
  await lab.screenshot('restore-dialog-dark');
  await row.locator('.jp-gpu-snapshot-delete').click();
  await row.locator('.jp-gpu-snapshot-delete', { hasText: 'Confirm delete' }).waitFor();
  await lab.screenshot('delete-confirm');
  await row.locator('.jp-gpu-snapshot-delete').click();
  await expect(
    dialog.locator('.jp-gpu-snapshot-empty', {
      hasText: 'No snapshot of this notebook yet'
    })
  ).toBeVisible();
  await lab.screenshot('snapshot-deleted');
  // Escape still closes the dialog after a delete took its button away.
  await page.keyboard.press('Escape');
  seen.escape_closed_dialog = await dialog
    .waitFor({ state: 'detached', timeout: 5000 })
    .then(() => true)
    .catch(() => false);
  if (!seen.escape_closed_dialog) {
    await dialog.locator('.jp-mod-reject').click();
  }
  await expect(status).toHaveText('No snapshot yet');
  seen.status_after_delete = await status.innerText();
  seen.snapshots_left = (await lab.snapshots()).length;
});

// A notebook on the plain python3 kernel: the button stays disabled and says why.
test('not-snapshot-ready', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await page.waitForFunction(
    () => {
      const node = document.querySelector<HTMLElement>('.jp-gpu-snapshot-button');
      const title = node?.querySelector('[title]')?.getAttribute('title') || '';
      return (
        node?.dataset.state === 'disabled' && title.startsWith('Snapshots unavailable')
      );
    },
    null,
    { timeout: STEP_TIMEOUT }
  );
  seen.disabled_tooltip = await lab.buttonTooltip();
  seen.kernel = await lab.kernelOf();
  await lab.showTooltip();
  await lab.screenshot('button-disabled');
  await lab.hideTooltip();
  // The palette entry is disabled too.
  await page.keyboard.press('Control+Shift+C');
  await page.locator('.lm-CommandPalette-input').fill('Snapshot kernel');
  const entry = page.locator('.lm-CommandPalette-item', { hasText: 'Snapshot kernel' });
  // JupyterLab keeps disabled commands in the palette's DOM but does not show them.
  await entry.first().waitFor({ state: 'attached', timeout: STEP_TIMEOUT });
  seen.palette_disabled = await entry
    .first()
    .evaluate(node => node.classList.contains('lm-mod-disabled'));
  await lab.screenshot('palette-entry-disabled');
  await page.keyboard.press('Escape');
  // Clicking the greyed-out button explains and offers to switch the kernel.
  await lab.clickSnapshot();
  seen.explanation = await lab.toast(/Snapshots need/);
  await lab.screenshot('button-click-explains');
  await lab
    .toasts('Snapshots need')
    .getByRole('button', { name: 'Change kernel…' })
    .click();
  const picker = page.locator('.jp-Dialog');
  await picker.waitFor({ timeout: STEP_TIMEOUT });
  seen.change_kernel_dialog = (
    await picker.locator('.jp-Dialog-header').innerText()
  ).trim();
  await lab.screenshot('change-kernel-dialog');
  await picker.locator('.jp-mod-reject').first().click();
});

// criu fails while dumping: an error notification names the step and the cause, and the
// kernel goes on answering.
test('save-fails', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  await lab.clickSnapshot();
  seen.error_toast = await lab.toast(/Snapshot failed/);
  await lab.screenshot('snapshot-failed');
  await lab.toasts('Snapshot failed').getByRole('button', { name: 'Details' }).click();
  const details = page.locator('.jp-Dialog');
  await details.waitFor({ timeout: STEP_TIMEOUT });
  seen.error_details = (await details.locator('.jp-Dialog-body').innerText()).trim();
  await lab.screenshot('error-details');
  await details.locator('.jp-mod-accept, .jp-mod-reject').first().click();
  await lab.buttonState('ready');
  seen.after_failure_output = await lab.runCell(1);
  await lab.screenshot('kernel-still-alive');
  seen.snapshots_left = (await lab.snapshots()).length;
});

// Going back to an earlier snapshot of the kernel that still runs: the dialog marks it and
// does not pre-select it; picked, one confirmation replaces the kernel, with no refusal on
// the way; the notebook then shows where the kernel went back to.
test('restore-over-running-kernel', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  await lab.clickSnapshot();
  await lab.toast(/Snapshot saved/);
  await lab.buttonState('ready');
  seen.changed_output = await lab.runCell(2);
  seen.kernel_before = await lab.kernelOf();

  await lab.recordToasts();
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog', {
    has: page.locator('.jp-gpu-snapshot-picker')
  });
  const row = dialog.locator('tr[data-snapshot-id]').first();
  await row.waitFor({ timeout: STEP_TIMEOUT });
  // The snapshot of the running kernel is marked, in this notebook's section, and not
  // pre-selected: with nothing selected, Restore waits for a choice.
  seen.row_text = (await row.innerText()).trim();
  seen.preselected = await dialog.locator('tr.jp-mod-selected').count();
  seen.restore_enabled_before = await lab.acceptEnabled(dialog);
  await lab.screenshot('dialog-marks-this-kernel');
  // The arrow keys move the selection.
  await dialog.locator('.jp-gpu-snapshot-picker').focus();
  await page.keyboard.press('ArrowDown');
  seen.selected_by_arrow = await dialog
    .locator('tr.jp-mod-selected')
    .evaluateAll(rows => rows.map(r => r.getAttribute('data-snapshot-id')));
  seen.first_row = await row.getAttribute('data-snapshot-id');
  await expect(dialog.locator('.jp-Dialog-footer .jp-mod-accept')).toBeEnabled();
  await dialog.locator('.jp-mod-accept').click();

  // One confirmation, in words, before anything happens.
  const confirm = page.locator('.jp-Dialog', { hasText: 'Go back to' });
  await confirm.waitFor({ timeout: STEP_TIMEOUT });
  seen.confirm_title = (await confirm.locator('.jp-Dialog-header').innerText()).trim();
  seen.confirm_text = (await confirm.locator('.jp-Dialog-body').innerText()).trim();
  seen.confirm_buttons = await confirm
    .locator('.jp-Dialog-footer button')
    .evaluateAll(buttons => buttons.map(b => (b as HTMLElement).innerText.trim()));
  await lab.screenshot('confirm-going-back');
  await confirm.getByRole('button', { name: 'Replace kernel' }).click();
  seen.restored_toast = await lab.toast(/Kernel restored/);
  await lab.buttonState('ready');
  seen.toasts = await lab.recordedToasts();
  seen.kernel_after_restore = await lab.kernelOf();
  // Where it went back to: the cell marked, the later one dimmed until it runs again.
  seen.restore_point = await page
    .locator(`${CURRENT} .jp-Cell[data-gpu-snapshot-restore-point]`)
    .evaluateAll(cells =>
      cells.map(c => [
        [...c.parentElement!.children].indexOf(c),
        c.getAttribute('data-gpu-snapshot-restore-point')
      ])
    );
  seen.dimmed = await page
    .locator(`${CURRENT} .jp-Cell.jp-gpu-snapshot-stale`)
    .evaluateAll(cells => cells.map(c => [...c.parentElement!.children].indexOf(c)));
  await lab.screenshot('went-back-to-here');
  seen.after_restore_output = await lab.runCell(1);
  await lab.screenshot('state-after-restore');
  seen.kernels = await lab.kernelIds();
});

// Notebook A's snapshot restored from notebook B while A's kernel still runs: the refusal
// names A's kernel, offers to shut down that one, and B's kernel is not touched before the
// restore replaces it.
test('restore-from-other-notebook', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook(OTHER_NOTEBOOK);
  await lab.buttonState('ready');
  seen.other_state = await lab.runCell(0);
  await lab.clickSnapshot();
  await lab.toast(/Snapshot saved/);
  seen.other_kernel = await lab.kernelOf(OTHER_NOTEBOOK);
  seen.snapshot_name = (await lab.snapshots())[0].name;

  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.kernel_before = await lab.kernelOf();
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog');
  const row = dialog.locator(`tr[data-snapshot-name="${seen.snapshot_name}"]`);
  await row.waitFor({ timeout: STEP_TIMEOUT });
  // This notebook has no snapshot: nothing is picked for it, and Restore waits for a
  // choice, whether clicked or asked for with Enter.
  seen.preselected = await dialog.locator('tr.jp-mod-selected').count();
  await expect(dialog.locator('.jp-Dialog-footer .jp-mod-accept')).toBeDisabled();
  seen.restore_enabled_before = await lab.acceptEnabled(dialog);
  await lab.screenshot('restore-needs-a-choice');
  await dialog.locator('.jp-gpu-snapshot-picker').focus();
  await page.keyboard.press('Enter');
  seen.dialog_after_enter = await dialog.count();
  await row.click();
  seen.restore_enabled_after = await lab.acceptEnabled(dialog);
  await lab.screenshot('dialog-other-notebook-snapshot');
  await dialog.locator('.jp-mod-accept').click();
  seen.refused_toast = await lab.toast(/Restore of .* failed/);
  // The progress notification went with the outcome; it used to come back beside it.
  await page.waitForTimeout(1500);
  seen.progress_toasts_left = await lab.toasts(/Restoring '[^']*'(…|:)/).count();
  await lab.screenshot('refused-names-other-notebook');
  const refused = lab.toasts('failed');
  seen.refused_buttons = await refused
    .getByRole('button')
    .evaluateAll(buttons =>
      buttons.map(b => (b as HTMLElement).innerText.trim()).filter(Boolean)
    );
  seen.kernels_after_refusal = (await lab.kernelIds()).sort();
  seen.kernel_after_refusal = await lab.kernelOf();

  await refused
    .getByRole('button', { name: /^Shut down .* kernel and restore$/ })
    .click();
  seen.restored_toast = await lab.toast(/Kernel restored/);
  await lab.buttonState('ready');
  seen.kernel_after_restore = await lab.kernelOf();
  seen.other_kernel_after_restore = await lab.kernelOf(OTHER_NOTEBOOK);
  seen.after_restore_output = await lab.runCell(1);
  await lab.screenshot('restored-into-this-notebook');
  seen.kernels = await lab.kernelIds();
});

// The Snapshots sidebar: a snapshot named at save time (shift-click) shows there with its
// facts; search and sort; restore, rename and delete from it; light and dark themes.
test('sidebar', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  await lab.clickSnapshot(['Shift']);
  const naming = page.locator('.jp-Dialog');
  await naming.locator('.jp-Dialog-body input').fill('sidebar-one');
  await lab.screenshot('name-at-save');
  await naming.locator('.jp-mod-accept').click();
  seen.saved_toast = await lab.toast(/Snapshot saved: 'sidebar-one'/);
  await lab.buttonState('ready');

  const sidebar = await lab.openSidebar();
  const item = sidebar.locator('[data-section="own"] [data-snapshot-name="sidebar-one"]');
  await item.waitFor({ timeout: STEP_TIMEOUT });
  const store = sidebar.locator('.jp-gpu-snapshot-store');
  await expect(store).toContainText('free');
  seen.store_text = (await store.innerText()).trim();
  seen.item_text = (await item.innerText()).trim();
  await lab.screenshot('sidebar-light');

  const search = sidebar.locator('.jp-gpu-snapshot-search');
  await search.fill('no-such-thing');
  seen.search_empty = await sidebar.locator('.jp-gpu-snapshot-empty').allInnerTexts();
  await search.fill('sidebar');
  seen.search_hits = await sidebar
    .locator('[data-snapshot-name]')
    .evaluateAll(items => items.map(i => i.getAttribute('data-snapshot-name')));
  await search.fill('');
  await sidebar.locator('.jp-gpu-snapshot-sort').selectOption('size');

  await lab.darkTheme();
  await item.waitFor();
  seen.dark_name_contrast = await lab.contrast(item.locator('.jp-gpu-snapshot-name'));
  await lab.screenshot('sidebar-dark');

  await lab.shutDownKernel();
  await item.locator('.jp-gpu-snapshot-restore').click();
  seen.restored_toast = await lab.toast(/Kernel restored from 'sidebar-one'/);
  await lab.buttonState('ready');
  seen.after_restore_output = await lab.runCell(1);
  await lab.screenshot('restored-from-sidebar');

  // Rename: a bad name is caught in the dialog as it is typed, which stays open; the
  // server re-signs the manifest for a good one.
  await item.locator('.jp-gpu-snapshot-rename').click();
  const ask = page.locator('.jp-Dialog');
  const field = ask.locator('input.jp-gpu-snapshot-name-input');
  await field.fill('bad/name');
  await expect(ask.locator('.jp-Dialog-footer .jp-mod-accept')).toBeDisabled();
  seen.rename_why = (await ask.locator('.jp-gpu-snapshot-name-why').innerText()).trim();
  seen.rename_field_invalid = await field.evaluate(
    node => !(node as HTMLInputElement).checkValidity()
  );
  await lab.screenshot('rename-refused-in-dialog');
  await page.keyboard.press('Enter');
  seen.rename_dialog_after_enter = await ask.count();
  seen.sidebar_errors_after_bad_name = await sidebar.locator('.jp-gpu-snapshot-error').count();
  await field.fill('sidebar-renamed');
  await expect(ask.locator('.jp-Dialog-footer .jp-mod-accept')).toBeEnabled();
  await lab.screenshot('rename');
  await ask.locator('.jp-mod-accept').click();
  const error = sidebar.locator('.jp-gpu-snapshot-error');
  const renamed = sidebar.locator(
    '[data-section="own"] [data-snapshot-name="sidebar-renamed"]'
  );
  await renamed.waitFor({ timeout: STEP_TIMEOUT });
  seen.renamed_names = (await lab.snapshots()).map(s => s.name);
  seen.error_after_rename = await error.count();
  await lab.screenshot('renamed-in-sidebar');

  await renamed.locator('.jp-gpu-snapshot-delete').click();
  await renamed.locator('.jp-gpu-snapshot-delete', { hasText: 'Confirm delete' }).click();
  await renamed.waitFor({ state: 'detached', timeout: STEP_TIMEOUT });
  seen.snapshots_left = (await lab.snapshots()).length;
  await lab.screenshot('deleted-from-sidebar');
});

// The snapshot panel widget (%gpu_snapshot widget) lives in the kernel's memory: after the
// notebook moves to a restored kernel, its output shows the restored widget, live, not
// "model not found"; the same after the page is reloaded while no kernel holds the widget.
test('widget-after-restore', async ({ lab, page }) => {
  const { seen } = lab;
  const widgetOutput = () =>
    page
      .locator(`${CURRENT} .jp-Notebook .jp-Cell`)
      .nth(3)
      .locator('.jp-OutputArea-output');
  const widgetText = async () => (await widgetOutput().allInnerTexts()).join('\n');
  const panelShows = async (pattern: string | RegExp) =>
    widgetOutput()
      .filter({ hasText: pattern })
      .first()
      .waitFor({ timeout: STEP_TIMEOUT });
  const dialog = page.locator('.jp-Dialog');
  /** Kernel > Restore, the snapshot of ``row`` picked, until the notebook runs it and its
   * widget outputs are the restored kernel's: the restore marks the panel until then, and
   * a widget's input typed into before would be drawn afresh and lost. */
  const restoreFromDialog = async (row: Locator) => {
    await (await lab.kernelMenu('gpu-snapshot:restore')).click();
    await row.waitFor({ timeout: STEP_TIMEOUT });
    await row.click();
    await dialog.locator('.jp-mod-accept').click();
    await lab.toast(/Kernel restored/);
    await lab.buttonState('ready');
    await page
      .locator(`${CURRENT}[data-gpu-snapshot-widgets="current"]`)
      .waitFor({ timeout: STEP_TIMEOUT });
  };
  /** A save with the widget's own form; what the widget shows once it lists ``name``. */
  const saveFromWidget = async (name: string) => {
    await widgetOutput().getByPlaceholder('name (optional)').fill(name);
    await widgetOutput().locator('button', { hasText: 'Save' }).click();
    await panelShows(name).catch(() => undefined);
    return widgetText();
  };
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  await lab.runCell(3);
  await panelShows(/This notebook's snapshots/);
  await lab.screenshot('widget-shown');
  await lab.clickSnapshot();
  await lab.toast(/Snapshot saved/);
  await lab.buttonState('ready');
  await panelShows(/Last snapshot/);
  await lab.saveNotebook();
  seen.snapshot_name = (await lab.snapshots())[0].name;

  // Reopened while its kernel is gone: JupyterLab cannot show the widget (no kernel holds
  // it); after the restore the notebook's output shows the restored one.
  await lab.shutDownKernel();
  await lab.openNotebook();
  await lab.buttonState('ready');
  // The fresh kernel JupyterLab started holds no widget.
  await panelShows(/model not found/).catch(() => undefined);
  seen.widget_before_restore = await widgetText();
  await lab.screenshot('reopened-without-kernel');
  // That is JupyterLab's own console error; what follows the restore must be clean.
  seen.errors_before_restore = seen.console_errors.splice(0);
  await restoreFromDialog(dialog.locator('tr[data-snapshot-id]').first());
  seen.widget_after_restore = await panelShows(seen.snapshot_name as string)
    .then(widgetText)
    .catch(widgetText);
  await lab.screenshot('widget-after-restore');
  // The restored widget is live: its Save button saves the restored kernel.
  seen.widget_after_save = await saveFromWidget('from-widget');
  await lab.screenshot('widget-live-after-restore');
  seen.after_restore_output = await lab.runCell(1);

  // Without a reload: the kernel shut down from the menu, the same snapshot restored. The
  // page still holds the models of the kernel before; the restored kernel's must replace
  // them, or the panel is a dead copy.
  await lab.shutDownKernel();
  await restoreFromDialog(dialog.locator(`tr[data-snapshot-name="${seen.snapshot_name}"]`));
  seen.widget_after_second_restore = await saveFromWidget('same-page');
  await lab.screenshot('widget-live-after-second-restore');
  seen.snapshots = (await lab.snapshots()).map(s => s.name).sort();
});

// Autosave (the server's interval set to seconds by the test): the status bar says
// "Autosaving…", then "Autosaved … (paused …)"; the sidebar shows the notebook's policy and
// the next autosave, and overrides it for this notebook (off, then on every 30 min).
test('autosave', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  await lab.recordStatusTexts();
  seen.state_output = await lab.runCell(0);
  // The status may say "Autosaved just now" from the listing before it has the autosave's
  // own record, with the pause: wait for that.
  const status = page.locator('.jp-gpu-snapshot-status', {
    hasText: /^Autosaved .*\(paused [\d.]+ s\)$/
  });
  await status.waitFor({ timeout: 90_000 });
  seen.status_item = (await status.innerText()).trim();
  seen.status_texts = await lab.recordedStatusTexts();
  await lab.screenshot('autosave-status');

  const sidebar = await lab.openSidebar();
  await lab.openSettings(sidebar);
  const section = sidebar.locator('[data-section="autosave"]');
  const text = async (selector: string) =>
    (await section.locator(selector).innerText()).trim();
  await section
    .locator('.jp-gpu-snapshot-autosave-last')
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.sidebar_policy = await text('.jp-gpu-snapshot-autosave-policy');
  seen.sidebar_last = await text('.jp-gpu-snapshot-autosave-last');
  seen.sidebar_next = await text('.jp-gpu-snapshot-autosave-next');
  await lab.screenshot('sidebar-autosave');

  const kernel = await lab.kernelOf();
  const policy = section.locator('.jp-gpu-snapshot-autosave-policy');
  await section.locator('.jp-gpu-snapshot-autosave-mode').selectOption('off');
  await section.getByRole('button', { name: 'Apply' }).click();
  await expect(policy).toHaveText(/^off/);
  seen.policy_off = await text('.jp-gpu-snapshot-autosave-policy');
  seen.server_off = (await lab.api(`gpu-snapshot/kernels/${kernel}/autosave`)).policy;

  await section.locator('.jp-gpu-snapshot-autosave-mode').selectOption('on');
  await section.locator('.jp-gpu-snapshot-autosave-interval').fill('30');
  await section.getByRole('button', { name: 'Apply' }).click();
  await expect(policy).toHaveText(/^every 30 min/);
  seen.policy_on = await text('.jp-gpu-snapshot-autosave-policy');
  seen.server_on = await lab.api(`gpu-snapshot/kernels/${kernel}/autosave`);
  await lab.screenshot('sidebar-autosave-overridden');

  // A server says where each snapshot is kept (location): the sidebar and the dialog show
  // it. This server has no remote store; its answers say "remote" here, so that the words
  // for a remote-only snapshot show once the sidebar has asked again.
  await page.route(/gpu-snapshot\/snapshots(\?|$)/, async route => {
    const response = await route.fetch();
    const listing = await response.json();
    listing.snapshots.forEach((s: any) => (s.location = 'remote'));
    await route.fulfill({ response, json: listing });
  });
  await section.locator('.jp-gpu-snapshot-autosave-mode').selectOption('default');
  await section.getByRole('button', { name: 'Apply' }).click();
  await expect(policy).toHaveText(/the server's setting/);
  seen.server_default = (
    await lab.api(`gpu-snapshot/kernels/${kernel}/autosave`)
  ).override;
  const where = sidebar
    .locator('.jp-gpu-snapshot-location[data-location="remote"]')
    .first();
  await where.waitFor({ timeout: STEP_TIMEOUT });
  seen.sidebar_location = (await where.innerText()).trim();
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog');
  const badge = dialog
    .locator('.jp-gpu-snapshot-location[data-location="remote"]')
    .first();
  await badge.waitFor({ timeout: STEP_TIMEOUT });
  seen.dialog_location = (await badge.innerText()).trim();
  await lab.screenshot('location-in-dialog');
  await page.keyboard.press('Escape');
});

// --- after a server restart: two runs, the server stopped between -------------------

test('before-shutdown', async ({ lab }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  seen.kernel_before = await lab.kernelOf();
  // Saved with the notebook, so the outputs are there again after the restart.
  await lab.saveNotebook();
  await lab.screenshot('state-set');
  // A second notebook with a kernel of its own: saved at shutdown too.
  await lab.openFromFileBrowser(OTHER_NOTEBOOK);
  await lab.buttonState('ready');
  seen.other_kernel = await lab.kernelOf(OTHER_NOTEBOOK);
  // A kernel that has run nothing is not saved at shutdown: give this one some work.
  seen.other_output = await lab.runCell(0);
  // Saved by hand after its work: the shutdown leaves it alone, and the restart offers
  // this snapshot, reason and all.
  await lab.clickSnapshot();
  await lab.toast(/Snapshot saved/);
  await lab.buttonState('ready');
  await lab.screenshot('second-notebook-open');
});

test('after-restart', async ({ lab, page }) => {
  const { seen } = lab;
  // The answers come at different times, the second while the first offer's toast is
  // still being drawn: the page's first notification waits for JupyterLab to load its
  // toast library, which is held here until the second notebook's offer was made.
  let releaseToasts: () => void = () => undefined;
  const toastsReleased = new Promise<void>(resolve => (releaseToasts = resolve));
  await page.route(/\/static\/[\w.-]+\.js$/, async route => {
    const response = await route.fetch();
    const body = await response.text();
    if (body.includes('Toastify__toast-container') && body.includes('onOpen')) {
      await toastsReleased;
    }
    await route.fulfill({ response, body });
  });
  let otherAnswered = false;
  let kernelsAsked: () => void = () => undefined;
  const kernelsAskedAfter = new Promise<void>(resolve => (kernelsAsked = resolve));
  await page.route(/gpu-snapshot\/snapshots\?.*latest=true/, async route => {
    await route.continue();
    if (route.request().url().includes(encodeURIComponent(OTHER_NOTEBOOK))) {
      otherAnswered = true;
    }
  });
  await page.route(/\/api\/kernels(\?.*)?$/, async route => {
    await route.continue();
    if (otherAnswered && route.request().method() === 'GET') {
      kernelsAsked(); // the second notebook's offer asked which kernels run: it is made
    }
  });

  await lab.openNotebook();
  // The notebook started a fresh kernel meanwhile; the restore replaces it.
  await lab.buttonState('ready');
  await expect(
    page
      .locator('.jp-StatusBar-Widget', { hasText: /Python 3 \(snapshots\) \| Idle/ })
      .first()
  ).toBeVisible();
  seen.fresh_kernel = await lab.kernelOf();
  // The first offer is made: the notification center counts it, its toast waits.
  await expect(page.locator('.jp-Notification-Status-Text')).toHaveText('1', {
    timeout: STEP_TIMEOUT
  });
  // A second notebook opens, and its answer comes: one offer names both.
  await lab.openFromFileBrowser(OTHER_NOTEBOOK);
  await kernelsAskedAfter;
  await page.evaluate(() => new Promise(resolve => setTimeout(resolve, 0)));
  releaseToasts();
  seen.merged_offer = await lab.toast(/Restore the kernels of 2 notebooks/);
  // A single notebook's offer shown before may slide out; none may stay.
  seen.single_offer_left = await lab
    .toasts(/Restore the kernel of /)
    .waitFor({ state: 'detached', timeout: 10_000 })
    .then(() => 0)
    .catch(() => 1);
  seen.offer_count = await lab.toasts(/Restore the kernels? of/).count();
  await lab.screenshot('restart-offer-names-both');
  const offer = lab.toasts(/Restore the kernels of/);
  await offer.getByRole('button', { name: 'Restore all' }).click();
  const restored = lab.toasts(/Kernel restored/);
  await restored.nth(1).waitFor({ timeout: STEP_TIMEOUT });
  seen.restored_toasts = await restored.allInnerTexts();
  seen.restored_toast = (seen.restored_toasts as string[])[0];
  await page.locator('.lm-TabBar-tab', { hasText: NOTEBOOK }).click();
  await lab.buttonState('ready');
  seen.kernel_after_restore = await lab.kernelOf();
  await lab.screenshot('kernel-restored');
  seen.after_restore_output = await lab.runCell(1);
  await lab.screenshot('state-after-restore');

  // The dialog in the dark theme, with a snapshot of this notebook (the one before
  // shutdown, this kernel's origin) and one of another: the badges stay readable, the
  // origin is marked, and the two sections' columns line up under the header.
  await lab.darkTheme();
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog');
  await dialog
    .locator('tbody')
    .nth(1)
    .locator('tr[data-snapshot-id]')
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.dialog_rows = await dialog.locator('tr[data-snapshot-id]').evaluateAll(rows =>
    rows.map(r => ({
      id: r.getAttribute('data-snapshot-id'),
      badges: [...r.querySelectorAll('.jp-gpu-snapshot-badge')].map(b =>
        (b as HTMLElement).innerText.trim()
      )
    }))
  );
  seen.dark_shutdown_badge_contrast = await lab.contrast(
    dialog.locator('.jp-gpu-snapshot-badge', { hasText: 'before shutdown' })
  );
  // Left edges of the header's cells and of each section's first row, in CSS pixels.
  seen.dialog_columns = await dialog
    .locator('.jp-gpu-snapshot-picker')
    .evaluate(picker => {
      const lefts = (row: Element | null) =>
        row ? [...row.children].map(cell => cell.getBoundingClientRect().left) : null;
      return {
        header: lefts(picker.querySelector('thead tr')),
        sections: [...picker.querySelectorAll('tbody')].map(body => ({
          title: body.querySelector('.jp-gpu-snapshot-section')?.textContent ?? null,
          first_row: lefts(body.querySelector('tr[data-snapshot-id]'))
        }))
      };
    });
  await lab.screenshot('restore-dialog-dark');
  await page.keyboard.press('Escape');
  await dialog.waitFor({ state: 'detached', timeout: STEP_TIMEOUT });

  seen.sessions = ((await lab.api('api/sessions')) as any[])
    .map(s => [s.path, s.kernel.id])
    .sort();
  seen.kernels = (await lab.kernelIds()).sort();
});

// Hibernate the kernel from the Kernel menu: the status bar says so; the next cell wakes
// it in the same kernel slot, and its output shows the state from before.
test('hibernate', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  seen.kernel_before = await lab.kernelOf();

  const item = await lab.kernelMenu('gpu-snapshot:hibernate');
  await lab.screenshot('kernel-menu-hibernate');
  await item.click();
  const status = page.locator('.jp-gpu-snapshot-status');
  await expect(status).toHaveText(/^Hibernated: /, { timeout: STEP_TIMEOUT });
  seen.status_hibernated = await status.innerText();
  seen.status_title = await status.getAttribute('title');
  seen.listed_state = ((await lab.api('api/kernels')) as any[]).find(
    k => k.id === seen.kernel_before
  )?.execution_state;
  await lab.screenshot('hibernated');
  const sidebar = await lab.openSidebar();
  const listed = sidebar.locator(
    `[data-section="hibernated"] [data-kernel-id="${seen.kernel_before}"]`
  );
  await listed.waitFor({ timeout: STEP_TIMEOUT });
  seen.sidebar_hibernated = await listed.innerText();
  await lab.screenshot('sidebar-hibernated');

  seen.after_wake_output = await lab.runCell(1);
  seen.kernel_after = await lab.kernelOf();
  await lab.screenshot('woken');
  // The waking note was shown while it mattered; the notebook file keeps none of it.
  await lab.saveNotebook();
  const saved = await lab.api(`api/contents/${NOTEBOOK}`);
  seen.saved_wake_cell_outputs = saved.content.cells[1].outputs;
  await expect(status).not.toHaveText(/^(Hibernated|Waking)/, { timeout: STEP_TIMEOUT });
  seen.status_after_wake = await status.innerText();
  await lab.screenshot('status-after-wake');
  await sidebar
    .locator('[data-section="hibernated"]')
    .waitFor({ state: 'detached', timeout: STEP_TIMEOUT })
    .catch(() => undefined);
  seen.sidebar_after_wake = await sidebar.locator('[data-section="hibernated"]').count();

  // This notebook's own choice: never hibernate by itself.
  await lab.openSettings(sidebar);
  const idle = sidebar.locator('[data-section="hibernate"]');
  seen.idle_policy_before = await idle.locator('.jp-gpu-snapshot-hibernate-policy').innerText();
  await idle.locator('.jp-gpu-snapshot-hibernate-mode').selectOption('never');
  await idle.locator('button[type="submit"]').click();
  await expect(idle.locator('.jp-gpu-snapshot-hibernate-policy')).toHaveText(
    /this notebook's setting/,
    { timeout: STEP_TIMEOUT }
  );
  seen.idle_policy = await idle.locator('.jp-gpu-snapshot-hibernate-policy').innerText();
  seen.server_idle = (
    await lab.api(`gpu-snapshot/kernels/${seen.kernel_before}/autosave`)
  ).override;
  await lab.screenshot('sidebar-hibernation-never');
});

// A save that also keeps a portable copy, asked for in the naming dialog (Shift-click);
// then the kernel is shut down. test_lab_ui.py re-signs the snapshot as another node's,
// whose image this node refuses, before fallback-restore.
test('fallback-save', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  await lab.clickSnapshot(['Shift']);
  const naming = page.locator('.jp-Dialog');
  await naming.locator('.jp-Dialog-body input').fill('portable-one');
  const portable = naming.locator('.jp-Dialog-checkbox');
  seen.portable_checkbox = (await portable.innerText()).trim();
  seen.portable_checked_at_first = await portable.locator('input').isChecked();
  await portable.locator('input').check();
  await lab.screenshot('save-with-portable-copy');
  await naming.locator('.jp-mod-accept').click();
  seen.saved_toast = await lab.toast(/Snapshot saved: 'portable-one'/);
  await lab.buttonState('ready');
  await lab.screenshot('saved-with-portable-copy');
  await lab.shutDownKernel();
});

// The restore of a snapshot whose image this node refuses: a dialog names the failure and
// offers the ways back the snapshot has; "Re-run the cells" starts a fresh kernel that runs
// them again, the notebook switches to it, and a report says which cells ran.
test('fallback-restore', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.kernel_before = await lab.kernelOf();
  await lab.recordToasts();
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  const picker = page.locator('.jp-Dialog', {
    has: page.locator('.jp-gpu-snapshot-picker')
  });
  const row = picker.locator('tr[data-snapshot-name="portable-one"]');
  await row.waitFor({ timeout: STEP_TIMEOUT });
  await row.click();
  seen.row_badges = await row.locator('.jp-gpu-snapshot-badge').allInnerTexts();
  seen.restore_modes = await picker
    .locator('.jp-gpu-snapshot-restore-mode option')
    .allInnerTexts();
  await lab.screenshot('restore-dialog-offers-a-fresh-kernel');
  // The image, as a plain Restore asks for it: this node refuses it.
  await picker.locator('.jp-mod-accept').click();

  const offer = page.locator('.jp-Dialog', {
    has: page.locator('.jp-gpu-snapshot-fallback')
  });
  await offer.waitFor({ timeout: STEP_TIMEOUT });
  seen.fallback_title = (await offer.locator('.jp-Dialog-header').innerText()).trim();
  seen.fallback_text = (
    await offer.locator('.jp-gpu-snapshot-fallback').innerText()
  ).trim();
  seen.fallback_buttons = await offer
    .locator('.jp-Dialog-footer button')
    .evaluateAll(buttons => buttons.map(b => (b as HTMLElement).innerText.trim()));
  seen.refused_toast = await lab.toast(/Restore of .* failed/);
  await lab.screenshot('fallback-offered');
  await offer
    .locator('.jp-Dialog-footer')
    .getByRole('button', { name: 'Re-run the cells' })
    .click();

  const report = page.locator('.jp-Dialog', {
    has: page.locator('.jp-gpu-snapshot-report')
  });
  await report.waitFor({ timeout: STEP_TIMEOUT });
  seen.report_title = (await report.locator('.jp-Dialog-header').innerText()).trim();
  seen.report_text = (await report.locator('.jp-gpu-snapshot-report').innerText()).trim();
  seen.replayed = await report
    .locator('[data-section="replayed"] li')
    .evaluateAll(items =>
      items.map(i => ({
        count: Number(i.getAttribute('data-count')),
        status: i.getAttribute('data-status')
      }))
    );
  seen.fallback_toast = await lab.toast(/A fresh kernel took the place of/);
  await lab.screenshot('fallback-report');
  await report
    .locator('.jp-Dialog-footer')
    .getByRole('button', { name: 'Close' })
    .click();
  await report.waitFor({ state: 'detached', timeout: STEP_TIMEOUT });
  // Taking a way back closed the failure's notification.
  seen.refused_toasts_left = await lab.toasts(/Restore of .* failed/).count();
  await lab.buttonState('ready');
  seen.kernel_after = await lab.kernelOf();
  seen.after_output = await lab.runCell(1);
  await lab.screenshot('state-after-fallback');
  seen.restore_toasts = await lab.recordedToasts();
  seen.kernels = await lab.kernelIds();
});

// --- a new user's first day: one server for these two --------------------------------

// A new notebook is Untitled.ipynb until its first save renames it: a snapshot taken
// before stays the notebook's (the sidebar, the dialog, the status bar and the magic
// agree), and the next new Untitled.ipynb, an empty kernel, has none and is offered none.
test('first-save-rename', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openLab();
  seen.first_tab = await lab.newNotebook();
  await lab.buttonState('ready');
  seen.set_output = await lab.runCode(0, "answer = 41\nprint('set', answer)");
  await lab.clickSnapshot();
  seen.saved_toast = await lab.toast(/Snapshot saved/);
  await lab.buttonState('ready');
  seen.kernel = await lab.kernelOf(seen.first_tab as string);

  // The first save asks for a name, and renames the file.
  await page.keyboard.press('Control+s');
  const ask = page.locator('.jp-Dialog', { hasText: 'Rename' });
  const name = ask.locator('input[type="text"]');
  await name.waitFor({ timeout: STEP_TIMEOUT });
  await name.fill('demo.ipynb');
  await ask.locator('.jp-mod-accept').click();
  await page
    .locator('.lm-TabBar-tab.lm-mod-current', { hasText: 'demo.ipynb' })
    .waitFor({ timeout: STEP_TIMEOUT });
  // A listing of the file browser's folder that ran across the rename fails in
  // jupyter_server (the file went between its listing and its stat), and JupyterLab says
  // so in a dialog; once the browser lists the new name, that listing is over.
  await page
    .locator('.jp-DirListing-item', { hasText: 'demo.ipynb' })
    .waitFor({ timeout: STEP_TIMEOUT });
  const stray = page.locator('.jp-Dialog', { hasText: 'Directory not found' });
  seen.stray_listing_error = await stray.count();
  if (seen.stray_listing_error) {
    await stray.getByRole('button', { name: 'Close' }).click();
  }

  const status = page.locator('.jp-gpu-snapshot-status');
  await expect(status).toHaveText(/^Snapshot (just now|\d+ min ago)$/);
  seen.status_demo = await status.innerText();
  const sidebar = await lab.openSidebar();
  const own = sidebar.locator('[data-section="own"]');
  await expect(own.locator('h3')).toHaveText('This notebook: demo.ipynb');
  await own.locator('[data-snapshot-id]').first().waitFor({ timeout: STEP_TIMEOUT });
  seen.sidebar_own = await own.locator('[data-snapshot-id]').evaluateAll(items =>
    items.map(i => [i.getAttribute('data-snapshot-name'), (i as HTMLElement).innerText])
  );
  seen.sidebar_others = await sidebar
    .locator('[data-section="others"] [data-snapshot-id]')
    .count();
  await lab.screenshot('snapshot-follows-rename');
  seen.magic_list = await lab.runCode(1, '%gpu_snapshot list');
  seen.magic_status = await lab.runCode(2, '%gpu_snapshot status');
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  const dialog = page.locator('.jp-Dialog', {
    has: page.locator('.jp-gpu-snapshot-picker')
  });
  await dialog.locator('tr[data-snapshot-id]').first().waitFor({ timeout: STEP_TIMEOUT });
  seen.dialog_sections = await dialog.locator('tbody').evaluateAll(bodies =>
    bodies.map(b => [
      b.querySelector('.jp-gpu-snapshot-section')?.textContent ?? '',
      [...b.querySelectorAll('tr[data-snapshot-id]')].map(r => (r as HTMLElement).innerText)
    ])
  );
  await lab.screenshot('dialog-after-rename');
  await dialog.locator('.jp-Dialog-footer .jp-mod-reject').click();
  await dialog.waitFor({ state: 'detached', timeout: STEP_TIMEOUT });

  // The next new notebook: Untitled.ipynb again, an empty kernel with no snapshot.
  await lab.recordToasts();
  const offerAsked = page.waitForResponse(
    r => r.url().includes('latest=true') && r.url().includes('Untitled.ipynb')
  );
  seen.second_tab = await lab.newNotebook();
  await lab.buttonState('ready');
  await offerAsked;
  await expect(status).toHaveText('No snapshot yet');
  seen.status_new = await status.innerText();
  await expect(
    sidebar.locator('[data-section="own"] h3')
  ).toHaveText(`This notebook: ${seen.second_tab}`);
  seen.sidebar_new_own = await sidebar
    .locator('[data-section="own"] [data-snapshot-id]')
    .count();
  await (await lab.kernelMenu('gpu-snapshot:restore')).click();
  await dialog.locator('tr[data-snapshot-id]').first().waitFor({ timeout: STEP_TIMEOUT });
  seen.new_dialog_own = (
    await dialog.locator('tbody').first().locator('.jp-gpu-snapshot-empty').allInnerTexts()
  ).map(t => t.trim());
  seen.new_dialog_selected = await dialog.locator('tr.jp-mod-selected').count();
  seen.new_dialog_restore_enabled = await lab.acceptEnabled(dialog);
  await lab.screenshot('new-untitled-has-none');
  await dialog.locator('.jp-Dialog-footer .jp-mod-reject').click();
  seen.toasts = await lab.recordedToasts();
});

// The save of a kernel with a few hundred MiB: its progress (the status bar's percent)
// only moves on, from the pause through the commit, and the sizes its notification gives
// agree with the saved snapshot's.
test('save-progress', async ({ lab, page }) => {
  const { seen } = lab;
  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.state_output = await lab.runCell(0);
  seen.big_output = await lab.runCell(3);
  await lab.recordToasts();
  await lab.recordStatusTexts();
  await lab.clickSnapshot();
  await lab
    .toasts(/Snapshot of .*: committing/)
    .first()
    .waitFor({ timeout: STEP_TIMEOUT });
  await lab.screenshot('save-progress');
  seen.saved_toast = await lab.toast(/Snapshot saved/);
  seen.status_texts = await lab.recordedStatusTexts();
  seen.toasts = await lab.recordedToasts();
  await lab.buttonState('ready');
  await page.keyboard.press('Escape');
});

// Rewind from a cell's context menu (the notebook's cells, written by pytest: x = 1, x = 2,
// print x, a long cell): the kernel goes back to before the second cell without running
// anything, x is 1 again, the second cell is marked as undone until it runs again, and the
// sidebar's timeline lists a point per cell, before and after. A rewind asked while a cell
// runs is refused in one message, and the kernel runs on.
test('rewind', async ({ lab, page }) => {
  const { seen } = lab;
  const cells = page.locator(`${CURRENT} .jp-Notebook .jp-Cell`);
  const countOf = async (index: number) =>
    (await cells.nth(index).locator('.jp-InputPrompt').innerText()).trim();
  const marked = () =>
    page
      .locator(`${CURRENT} .jp-Cell.jp-gpu-snapshot-undone`)
      .evaluateAll(nodes =>
        nodes.map(c => [
          [...c.parentElement!.children].indexOf(c),
          c.getAttribute('data-gpu-snapshot-undone')
        ])
      );
  /** Opens the context menu of a cell (on its prompt) and gives the rewind's entry. */
  const rewindEntry = async (index: number) => {
    await cells.nth(index).locator('.jp-InputPrompt').click({ button: 'right' });
    const entry = page.locator(
      '.lm-Menu-item[data-command="gpu-snapshot:rewind-to-cell"]'
    );
    await entry.waitFor({ state: 'visible', timeout: STEP_TIMEOUT });
    return entry;
  };

  await lab.openNotebook();
  await lab.buttonState('ready');
  seen.kernel = await lab.kernelOf();
  for (const index of [0, 1]) {
    expect(await page.notebook.runCell(index), `run cell ${index}`).toBe(true);
  }
  seen.prompts = [await countOf(0), await countOf(1)];

  const sidebar = await lab.openSidebar();
  const timeline = sidebar.locator('[data-section="timeline"]');
  const points = timeline.locator('.jp-gpu-snapshot-point');
  const listed = () =>
    points.evaluateAll(nodes =>
      nodes.map(n => [
        Number(n.getAttribute('data-count')),
        (n.querySelector('.jp-gpu-snapshot-point-names') as HTMLElement).innerText.trim()
      ])
    );
  await expect(points).toHaveCount(2, { timeout: STEP_TIMEOUT });
  seen.points_before = await listed();
  seen.timeline_use = (
    await timeline.locator('.jp-gpu-snapshot-timeline-use').innerText()
  ).trim();
  await lab.screenshot('timeline-before-rewind');

  const entry = await rewindEntry(1);
  seen.menu_entry = (await entry.innerText()).trim();
  seen.menu_entry_disabled = await entry.evaluate(node =>
    node.classList.contains('lm-mod-disabled')
  );
  await lab.screenshot('context-menu-rewind');
  await entry.click();
  seen.rewound_toast = await lab.toast(/Kernel rewound/);
  seen.marked = await marked();
  await lab.screenshot('cell-marked-undone');

  await lab.toasts('Kernel rewound').getByRole('button', { name: 'Report' }).click();
  const report = page.locator('.jp-Dialog', {
    has: page.locator('.jp-gpu-snapshot-report')
  });
  await report.waitFor({ timeout: STEP_TIMEOUT });
  seen.report_title = (await report.locator('.jp-Dialog-header').innerText()).trim();
  seen.report_text = (await report.locator('.jp-Dialog-body').innerText()).trim();
  await lab.screenshot('rewind-report');
  await report.locator('.jp-mod-accept').click();
  await report.waitFor({ state: 'detached', timeout: STEP_TIMEOUT });

  // The point of the undone cell is gone from the timeline.
  await expect(points).toHaveCount(1, { timeout: STEP_TIMEOUT });
  seen.points_after = await listed();

  seen.after_rewind_output = await lab.runCell(2);
  seen.marked_after_another_cell = await marked();
  await lab.screenshot('value-back');
  // The undone cell runs again: its mark goes, and its effect is back.
  expect(await page.notebook.runCell(1), 'run cell 1 again').toBe(true);
  seen.marked_after_rerun = await marked();
  seen.after_rerun_output = await lab.runCell(2);
  await expect(points).toHaveCount(4, { timeout: STEP_TIMEOUT });
  seen.points_after_rerun = await listed();
  await lab.screenshot('timeline-after-rerun');

  // A rewind while a cell runs: refused, in one message; the cell is interrupted after.
  expect(await page.notebook.runCell(3, { wait: false }), 'start cell 3').toBe(true);
  await cells
    .nth(3)
    .locator('.jp-OutputArea-output', { hasText: 'sleeping' })
    .waitFor({ timeout: STEP_TIMEOUT });
  await (await rewindEntry(0)).click();
  seen.busy_toast = await lab.toast(/Could not rewind/);
  await lab.screenshot('rewind-refused-while-running');
  await (await lab.kernelMenu('kernelmenu:interrupt')).click();
  await cells
    .nth(3)
    .locator('.jp-OutputArea-output', { hasText: 'KeyboardInterrupt' })
    .waitFor({ timeout: STEP_TIMEOUT });
  seen.marked_at_end = await marked();
  seen.after_refusal_output = await lab.runCell(2);
});
