// Galata's test, fitted to our servers, with the few helpers galata has none of: the
// extension's toolbar button and status item, notifications as the user sees them,
// contrast, and the record of what a scenario saw, which test_lab_ui.py checks.
import { expect, IJupyterLabPageFixture, test as galataTest } from '@jupyterlab/galata';
import type { APIRequestContext, Locator } from '@playwright/test';
import fs from 'node:fs';
import path from 'node:path';

export { expect };

export const STEP_TIMEOUT = 60_000;
// The notebook on show: with several open, the others stay in the page, hidden.
export const CURRENT = '.jp-NotebookPanel:not(.lm-mod-hidden)';

/** What a scenario saw, keyed as test_lab_ui.py reads it; saved as seen.json. */
export type Seen = Record<string, unknown> & {
  steps: string[];
  console_errors: string[];
};

/** The scenario's own helpers, bound to its page and its server. */
export class Lab {
  constructor(
    readonly page: IJupyterLabPageFixture,
    readonly request: APIRequestContext,
    readonly seen: Seen,
    readonly artifacts: string
  ) {}

  private shots = 0;

  /** A screenshot of the step just done: ARTIFACTS/NN-name.png. */
  async screenshot(name: string): Promise<void> {
    this.shots += 1;
    const file = path.join(
      this.artifacts,
      `${String(this.shots).padStart(2, '0')}-${name}.png`
    );
    await this.page.screenshot({ path: file });
    this.seen.steps.push(name);
    const docs = DOCS_IMAGES[`${path.basename(this.artifacts)}/${name}`];
    if (docs && process.env.UPDATE_DOCS_IMAGES) {
      fs.copyFileSync(file, path.join(DOCS_DIR, docs));
    }
  }

  // --- the server, through the `request` fixture (galata's base URL and our token) ---

  async api(endpoint: string): Promise<any> {
    const response = await this.request.get(endpoint);
    expect(response.ok(), `GET ${endpoint}: ${response.status()}`).toBe(true);
    const text = await response.text();
    return text ? JSON.parse(text) : null;
  }

  async kernelOf(notebook = NOTEBOOK): Promise<string | null> {
    const sessions: any[] = await this.api('api/sessions');
    const session = sessions.find(s => s.path === notebook);
    return session ? session.kernel.id : null;
  }

  async snapshots(): Promise<any[]> {
    return (await this.api('gpu-snapshot/snapshots')).snapshots;
  }

  async kernelIds(): Promise<string[]> {
    return ((await this.api('api/kernels')) as any[]).map(k => k.id);
  }

  // --- JupyterLab, through galata's page ---

  /** Opens the notebook from its URL, a fresh workspace, and waits for its cells. */
  async openNotebook(notebook = NOTEBOOK): Promise<void> {
    await this.page.goto(`tree/${notebook}?reset`);
    await this.page
      .locator('.jp-NotebookPanel .jp-Cell')
      .first()
      .waitFor({ timeout: STEP_TIMEOUT });
  }

  /** Opens JupyterLab on a fresh workspace, its launcher and no notebook. */
  async openLab(): Promise<void> {
    await this.page.goto('?reset');
    await this.page.locator('.jp-Launcher').first().waitFor({ timeout: STEP_TIMEOUT });
  }

  /** Opens a notebook of the server's root from the file browser (galata's helper). */
  async openFromFileBrowser(notebook: string): Promise<void> {
    expect(await this.page.notebook.openByPath(notebook), `open ${notebook}`).toBe(true);
    await this.page
      .locator('.lm-TabBar-tab.lm-mod-current', { hasText: notebook })
      .waitFor({ timeout: STEP_TIMEOUT });
  }

  /** Runs a cell of the notebook on show (galata's helper) and gives its output's text. */
  async runCell(index: number): Promise<string> {
    expect(await this.page.notebook.runCell(index), `run cell ${index}`).toBe(true);
    const output = this.page
      .locator(`${CURRENT} .jp-Notebook .jp-Cell`)
      .nth(index)
      .locator('.jp-OutputArea-output');
    await output.first().waitFor({ state: 'visible', timeout: STEP_TIMEOUT });
    return (await output.allInnerTexts()).join('\n').trim();
  }

  /** Saves the notebook on show (outputs included) and waits until it is clean. */
  async saveNotebook(): Promise<void> {
    expect(await this.page.notebook.save(), 'save the notebook').toBe(true);
    await this.page
      .locator('.lm-TabBar-tab.jp-mod-dirty')
      .waitFor({ state: 'detached', timeout: STEP_TIMEOUT });
  }

  async darkTheme(): Promise<void> {
    await this.page.theme.setDarkTheme();
    await expect(this.page.locator('body')).toHaveAttribute(
      'data-jp-theme-name',
      'JupyterLab Dark'
    );
  }

  /** Opens the Kernel menu (galata's helper) and gives the entry of a command. */
  async kernelMenu(command: string): Promise<Locator> {
    expect(
      await this.page.menu.openLocator('Kernel'),
      'open the Kernel menu'
    ).not.toBeNull();
    const item = this.page.locator(`.lm-Menu-item[data-command="${command}"]`);
    await item.waitFor({ state: 'visible', timeout: STEP_TIMEOUT });
    return item;
  }

  async shutDownKernel(): Promise<void> {
    await (await this.kernelMenu('kernelmenu:shutdown')).click();
    await this.buttonState('disabled');
  }

  async openSidebar(): Promise<Locator> {
    await this.page.sidebar.openTab('jp-gpu-snapshot-sidebar');
    return this.page.locator('#jp-gpu-snapshot-sidebar');
  }

  /** Unfolds the sidebar's settings of the current notebook (autosave, hibernation). */
  async openSettings(sidebar: Locator): Promise<Locator> {
    const settings = sidebar.locator('details.jp-gpu-snapshot-settings');
    await settings.waitFor({ timeout: STEP_TIMEOUT });
    if (!(await settings.evaluate(node => (node as HTMLDetailsElement).open))) {
      await settings.locator('summary').click();
    }
    return settings;
  }

  /** A new notebook on ``kernel``, as File › New › Notebook makes it (Untitled.ipynb). */
  async newNotebook(kernel = 'python3-snapshot'): Promise<string> {
    const before = await this.page
      .locator('.lm-TabBar-tab.lm-mod-current')
      .innerText()
      .catch(() => '');
    await this.page.evaluate(async kernelName => {
      await (window as any).jupyterapp.commands.execute('notebook:create-new', {
        kernelName
      });
    }, kernel);
    const tab = this.page.locator('.lm-TabBar-tab.lm-mod-current', {
      hasText: /Untitled\d*\.ipynb/
    });
    await expect(tab).not.toHaveText(before, { timeout: STEP_TIMEOUT });
    await this.page
      .locator(`${CURRENT} .jp-Cell`)
      .first()
      .waitFor({ timeout: STEP_TIMEOUT });
    return (await tab.innerText()).trim();
  }

  /** Types ``source`` into a cell of the notebook on show, runs it, gives its output. */
  async runCode(index: number, source: string): Promise<string> {
    const cells = await this.page.notebook.getCellCount();
    const typed =
      index < cells
        ? await this.page.notebook.setCell(index, 'code', source)
        : await this.page.notebook.addCell('code', source);
    expect(typed, `type cell ${index}`).toBe(true);
    return this.runCell(index);
  }

  /** Whether the dialog's accepting button (Restore, Rename) can be clicked. */
  async acceptEnabled(dialog: Locator): Promise<boolean> {
    return dialog.locator('.jp-Dialog-footer .jp-mod-accept').isEnabled();
  }

  // --- the extension's toolbar button ---

  snapshotButton(): Locator {
    return this.page.locator(`${CURRENT} .jp-gpu-snapshot-button`);
  }

  async clickSnapshot(modifiers: 'Shift'[] = []): Promise<void> {
    await this.snapshotButton()
      .locator('.jp-ToolbarButtonComponent')
      .click({ modifiers });
  }

  async buttonState(state: string): Promise<void> {
    await this.page
      .locator(`${CURRENT} .jp-gpu-snapshot-button[data-state="${state}"]`)
      .waitFor({ timeout: STEP_TIMEOUT });
  }

  async buttonTooltip(): Promise<string | null> {
    return this.snapshotButton().locator('[title]').first().getAttribute('title');
  }

  /** Headless chromium draws no native tooltips: the title in a box of our own. */
  async showTooltip(): Promise<void> {
    await this.page.evaluate(panel => {
      const button = document.querySelector(`${panel} .jp-gpu-snapshot-button [title]`)!;
      const box = button.getBoundingClientRect();
      const tip = document.createElement('div');
      tip.id = 'ui-test-tooltip';
      tip.textContent = `tooltip: ${button.getAttribute('title')}`;
      Object.assign(tip.style, {
        position: 'fixed',
        left: `${box.left}px`,
        top: `${box.bottom + 4}px`,
        maxWidth: '560px',
        padding: '4px 6px',
        zIndex: '10000',
        whiteSpace: 'pre-wrap',
        background: '#ffffe1',
        border: '1px solid #888',
        font: '12px sans-serif'
      });
      document.body.appendChild(tip);
    }, CURRENT);
  }

  async hideTooltip(): Promise<void> {
    await this.page.evaluate(() => document.getElementById('ui-test-tooltip')?.remove());
  }

  // --- notifications as shown (JupyterLab's toasts) ---

  toasts(pattern?: string | RegExp): Locator {
    const all = this.page.locator('.Toastify__toast');
    return pattern === undefined ? all : all.filter({ hasText: pattern });
  }

  /** Waits for a notification, lets it slide fully in, and gives its text. */
  async toast(pattern: string | RegExp): Promise<string> {
    const toast = this.toasts(pattern).first();
    await toast.waitFor({ state: 'visible', timeout: STEP_TIMEOUT });
    await toast
      .evaluate(
        node =>
          new Promise<void>(resolve => {
            const settled = () =>
              node.getBoundingClientRect().right <= window.innerWidth
                ? resolve()
                : requestAnimationFrame(settled);
            settled();
          })
      )
      .catch(() => undefined);
    return (await toast.innerText()).trim();
  }

  /** From now on, every text any notification shows, in order (progress is short-lived). */
  async recordToasts(): Promise<void> {
    await this.recordTexts('__toasts', '.Toastify__toast');
  }

  async recordedToasts(): Promise<string[]> {
    return this.page.evaluate(() => (window as any).__toasts);
  }

  /** From now on, every text the extension's status item shows, in order. */
  async recordStatusTexts(): Promise<void> {
    await this.recordTexts('__statusTexts', '.jp-gpu-snapshot-status');
  }

  async recordedStatusTexts(): Promise<string[]> {
    return this.page.evaluate(() => (window as any).__statusTexts);
  }

  private async recordTexts(key: string, selector: string): Promise<void> {
    await this.page.evaluate(
      ([key, selector]) => {
        const texts: string[] = ((window as any)[key] = []);
        const record = () => {
          for (const node of document.querySelectorAll<HTMLElement>(selector)) {
            const text = (node.innerText || node.textContent || '').trim();
            if (text && texts[texts.length - 1] !== text) {
              texts.push(text);
            }
          }
        };
        new MutationObserver(record).observe(document.body, {
          subtree: true,
          childList: true,
          characterData: true
        });
      },
      [key, selector]
    );
  }

  /**
   * The WCAG contrast ratio of an element's text colour on the background it shows on:
   * its own, or, where that is transparent, its nearest ancestor's (a badge's, say).
   */
  async contrast(locator: Locator): Promise<number> {
    return locator.evaluate(node => {
      const rgba = (value: string) => {
        const [r, g, b, a = 1] = value.match(/[\d.]+/g)!.map(Number);
        return { rgb: [r, g, b], alpha: a };
      };
      // Translucent backgrounds lie over their ancestors': blend them down to an opaque one.
      const layers: { rgb: number[]; alpha: number }[] = [];
      for (let at: Element | null = node; at; at = at.parentElement) {
        const layer = rgba(getComputedStyle(at).backgroundColor);
        if (layer.alpha > 0) {
          layers.push(layer);
        }
        if (layer.alpha >= 1) {
          break;
        }
      }
      let background = [255, 255, 255]; // the canvas, where no ancestor paints one
      for (const { rgb, alpha } of layers.reverse()) {
        background = background.map((c, i) => rgb[i] * alpha + c * (1 - alpha));
      }
      const lin = (c: number) =>
        (c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
      const luminance = ([r, g, b]: number[]) =>
        0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
      const text = luminance(rgba(getComputedStyle(node).color).rgb);
      const back = luminance(background);
      return (Math.max(text, back) + 0.05) / (Math.min(text, back) + 0.05);
    });
  }
}

export const NOTEBOOK = process.env.NOTEBOOK ?? 'state.ipynb';
export const OTHER_NOTEBOOK = process.env.OTHER_NOTEBOOK ?? '';
const ARTIFACTS =
  process.env.ARTIFACTS ?? path.resolve(__dirname, '../../../test-artifacts/ui');
const DOCS_DIR = path.resolve(__dirname, '../../../docs/images');

// The screenshots docs/labextension.md shows: scenario/step -> docs/images/ file, copied
// there when UPDATE_DOCS_IMAGES is set.
const DOCS_IMAGES: Record<string, string> = {
  'round-trip/restore-dialog-dark': 'restore-dialog-dark.png',
  'restore-from-other-notebook/refused-names-other-notebook':
    'refused-restore-names-other-notebook.png',
  'restore-from-other-notebook/restore-needs-a-choice': 'restore-needs-a-choice.png',
  'restore-over-running-kernel/confirm-going-back': 'go-back-confirmation.png',
  'restore-over-running-kernel/went-back-to-here': 'restore-point.png',
  'sidebar/sidebar-light': 'sidebar-light.png',
  'sidebar/sidebar-dark': 'sidebar-dark.png',
  'sidebar/rename-refused-in-dialog': 'rename-checked.png',
  'autosave/sidebar-autosave': 'autosave.png',
  'after-restart/restart-offer-names-both': 'restart-offer.png',
  'first-save-rename/snapshot-follows-rename': 'snapshot-follows-rename.png',
  'save-progress/save-progress': 'save-progress.png',
  'rewind/cell-marked-undone': 'rewind-marked-cell.png'
};

// JupyterLab's debugger logs this when a kernel it asks about is shut down, as the
// port-holder remedy does on purpose; any other console error is recorded.
const DEBUGGER_RACE = /^Could not restore the debugger state: Canceled future/;

export const test = galataTest.extend<{ lab: Lab }>({
  // The scenarios open notebooks, not the launcher: ready once the splash screen is gone.
  waitForApplication: async ({}, use) => {
    await use(async page => {
      await page.locator('#jupyterlab-splash').waitFor({ state: 'detached' });
    });
  },
  // The notebooks are pytest's, in the server's root: no folder per test.
  tmpPath: async ({}, use) => {
    await use('');
  },
  // The kernels and sessions are left to the server and to pytest, which stops it: a
  // scenario's kernels must outlive it (snapshot on shutdown).
  kernels: async ({}, use) => {
    await use(null as any);
  },
  sessions: async ({}, use) => {
    await use(null as any);
  },
  lab: async ({ page, request }, use, testInfo) => {
    const scenario = testInfo.title;
    const artifacts = path.join(ARTIFACTS, scenario);
    fs.mkdirSync(artifacts, { recursive: true });
    for (const old of fs.readdirSync(artifacts).filter(f => f.endsWith('.png'))) {
      fs.rmSync(path.join(artifacts, old));
    }
    const seen: Seen = { scenario, steps: [], console_errors: [] };
    page.on('console', message => {
      if (message.type() === 'error' && !DEBUGGER_RACE.test(message.text())) {
        // Chromium's "Failed to load resource" names no resource: add where it came from.
        const where = message.location().url;
        seen.console_errors.push(
          `${message.text().slice(0, 500)}${where ? ` (${where})` : ''}`
        );
      }
    });
    page.on('pageerror', error => seen.console_errors.push(String(error).slice(0, 500)));
    const lab = new Lab(page, request, seen, artifacts);
    try {
      await use(lab);
    } finally {
      if (testInfo.status !== testInfo.expectedStatus) {
        seen.error = testInfo.error?.message ?? testInfo.status;
        await lab.screenshot('FAILED').catch(() => undefined);
      }
      fs.writeFileSync(path.join(artifacts, 'seen.json'), JSON.stringify(seen, null, 1));
    }
  }
});
