/**
 * The Snapshots sidebar in JupyterLab's left area: this notebook's snapshots and all the
 * others, searchable and sortable, with restore and delete, the store's size and free
 * disk, and the notebook's autosave state with its per-notebook override. Added to the shell by the plugin; it refreshes while it is shown.
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { InputDialog } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import { ReactWidget } from '@jupyterlab/ui-components';
import { Poll } from '@lumino/polling';
import * as React from 'react';
import {
  IDLE_POLICY_FIELDS,
  idleOverride,
  type AutosaveOverride,
  type HibernationTier,
  type IAutosaveState,
  type IHibernation,
  type ISnapshotSummary
} from './api';
import { DeleteButtons } from './confirm';
import type { SnapshotController } from './controller';
import {
  describeAutosavePolicy,
  describeFreed,
  describeGpu,
  describeHibernation,
  describeIdlePolicy,
  describeLocation,
  describeNextAutosave,
  formatAge,
  formatBytes,
  formatSnapshotSize,
  formatSeconds,
  formatTime
} from './format';
import { FallbackOfferBadge } from './fallback';
import { snapshotIcon } from './icons';

const NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

type SortKey = 'newest' | 'oldest' | 'name' | 'size';

const SORTS: { [key in SortKey]: (a: ISnapshotSummary, b: ISnapshotSummary) => number } =
  {
    newest: (a, b) => b.created - a.created,
    oldest: (a, b) => a.created - b.created,
    name: (a, b) => a.name.localeCompare(b.name),
    size: (a, b) => b.size_bytes - a.size_bytes
  };

function reasonLabel(reason: string, trans: TranslationBundle): string {
  const labels: { [reason: string]: string } = {
    user: trans.__('saved by hand'),
    autosave: trans.__('autosave'),
    shutdown: trans.__('before shutdown'),
    hibernate: trans.__('hibernation')
  };
  return labels[reason] ?? reason;
}

/** The sidebar section (and class names) of each tier's idle time. */
const IDLE_SECTIONS: { [tier in HibernationTier]: string } = {
  gpu: 'release-gpu',
  process: 'hibernate'
};

/** The autosave fields that are about hibernation: each has its own section. */
const IDLE_FIELDS: string[] = Object.values(IDLE_POLICY_FIELDS);

/** Whether a snapshot matches the search text (name, id, notebook, host, reason). */
export function matches(s: ISnapshotSummary, search: string): boolean {
  const needle = search.trim().toLowerCase();
  if (!needle) {
    return true;
  }
  return [s.name, s.id, s.notebook_path ?? '', s.host ?? '', s.reason]
    .join(' ')
    .toLowerCase()
    .includes(needle);
}

export class SnapshotsSidebar extends ReactWidget {
  constructor(
    private readonly _controller: SnapshotController,
    private readonly _tracker: INotebookTracker,
    refreshSeconds: number,
    private readonly _trans: TranslationBundle
  ) {
    super();
    this.id = 'jp-gpu-snapshot-sidebar';
    this.addClass('jp-gpu-snapshot-sidebar');
    this.title.icon = snapshotIcon;
    this.title.caption = _trans.__('Snapshots');
    _tracker.currentChanged.connect(() => this.update());
    _controller.changed.connect(() => this._poll.refresh());
    this._poll = new Poll({
      auto: true,
      factory: () => this.reload(),
      frequency: { interval: refreshSeconds * 1000, backoff: true, max: 300_000 },
      name: 'jupyter-gpu-snapshot:sidebar',
      standby: () => !this.isVisible || 'when-hidden'
    });
  }

  /** Called by the plugin when the setting changes. */
  setRefreshSeconds(seconds: number): void {
    const interval = seconds * 1000;
    this._poll.frequency = { interval, backoff: true, max: 300_000 };
  }

  async reload(): Promise<void> {
    try {
      const listing = await this._controller.api.listing();
      this._snapshots = listing.snapshots;
      this._freeBytes = listing.store?.free_bytes ?? null;
      const kernelId = this._controller.polledKernel(this._tracker.currentWidget);
      // Servers without autosave answer 404: the section is left out.
      this._autosave = kernelId
        ? await this._controller.api.autosave(kernelId).catch(() => null)
        : null;
      // Servers without hibernation answer 404: the section is left out.
      this._hibernated = await this._controller.api.hibernation().catch(() => []);
      this._listingError = null;
    } catch (error) {
      this._listingError = (error as Error).message;
    }
    this._loaded = true;
    this.update();
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
  }

  protected onAfterShow(): void {
    void this._poll.refresh();
  }

  render(): JSX.Element {
    const trans = this._trans;
    const panel = this._tracker.currentWidget;
    const path = panel?.context.path ?? null;
    const shown = this._snapshots
      .filter(s => matches(s, this._search))
      .sort(SORTS[this._sort]);
    const own = path ? shown.filter(s => s.notebook_path === path) : [];
    const others = shown.filter(s => !path || s.notebook_path !== path);
    const total = this._snapshots.reduce((sum, s) => sum + s.size_bytes, 0);
    return (
      <div className="jp-gpu-snapshot-sidebar-body">
        <header className="jp-gpu-snapshot-sidebar-header">
          <h2>{trans.__('Snapshots')}</h2>
          <div
            className="jp-gpu-snapshot-store"
            title={trans.__('The snapshot store on the server')}
          >
            {this._freeBytes !== null
              ? trans._n(
                  '%1 in the store, %2, %3 free',
                  '%1 in the store, %2, %3 free',
                  this._snapshots.length,
                  formatBytes(total, trans),
                  formatBytes(this._freeBytes, trans)
                )
              : trans._n(
                  '%1 in the store, %2',
                  '%1 in the store, %2',
                  this._snapshots.length,
                  formatBytes(total, trans)
                )}
          </div>
          {this._criuNotice(panel)}
          <div className="jp-gpu-snapshot-controls">
            <input
              type="search"
              className="jp-gpu-snapshot-search"
              placeholder={trans.__('Search name, notebook, host…')}
              aria-label={trans.__('Search snapshots')}
              value={this._search}
              onChange={event => {
                this._search = event.target.value;
                this.update();
              }}
            />
            <select
              className="jp-gpu-snapshot-sort"
              aria-label={trans.__('Sort snapshots')}
              value={this._sort}
              onChange={event => {
                this._sort = event.target.value as SortKey;
                this.update();
              }}
            >
              <option value="newest">{trans.__('Newest first')}</option>
              <option value="oldest">{trans.__('Oldest first')}</option>
              <option value="name">{trans.__('By name')}</option>
              <option value="size">{trans.__('Largest first')}</option>
            </select>
          </div>
        </header>
        {(this._error ?? this._listingError) && (
          <p className="jp-gpu-snapshot-error">{this._error ?? this._listingError}</p>
        )}
        {!this._loaded ? (
          <p className="jp-gpu-snapshot-empty">{trans.__('Loading snapshots…')}</p>
        ) : (
          <>
            {this._hibernationSection()}
            {path && this._autosaveSection()}
            {path && this._idleSection('gpu')}
            {path && this._idleSection('process')}
            {path &&
              this._section(trans.__('This notebook: %1', path), own, panel, 'own')}
            {this._section(
              path ? trans.__('All others') : trans.__('All snapshots'),
              others,
              panel,
              'others'
            )}
          </>
        )}
      </div>
    );
  }

  /** A server whose criu lacks our patches restores slower: said under the store, with
   * the server's why in the title. */
  private _criuNotice(panel: NotebookPanel | null): JSX.Element | null {
    const kernelId = this._controller.polledKernel(panel);
    const criu = this._controller.entry(kernelId)?.status?.criu;
    if (!criu || criu.fast_fill !== false) {
      return null;
    }
    return (
      <div className="jp-gpu-snapshot-criu" title={criu.detail}>
        {this._trans.__(
          'Stock criu %1 on this server: restores take longer',
          criu.version ?? ''
        )}
      </div>
    );
  }

  /** The server's hibernated kernels, each with the memory it freed and a way to wake it. */
  private _hibernationSection(): JSX.Element | null {
    const trans = this._trans;
    if (this._hibernated.length === 0) {
      return null;
    }
    return (
      <section className="jp-gpu-snapshot-sidebar-section" data-section="hibernated">
        <h3>{trans.__('Hibernated kernels')}</h3>
        <ul>
          {this._hibernated.map(k => (
            <li
              key={k.kernel_id}
              className="jp-gpu-snapshot-item"
              data-kernel-id={k.kernel_id}
            >
              <div className="jp-gpu-snapshot-item-title">
                <span className="jp-gpu-snapshot-name" title={k.kernel_id}>
                  {k.notebook_path ?? k.kernel_id}
                </span>
              </div>
              <div className="jp-gpu-snapshot-item-facts">
                {k.state === 'hibernated' ? (
                  <>
                    <span>{describeFreed(k, trans)}</span>
                    {k.since && (
                      <span title={formatTime(k.since)}>
                        {trans.__('hibernated %1', formatAge(k.since, undefined, trans))}
                      </span>
                    )}
                  </>
                ) : (
                  <span>{describeHibernation(k, trans)?.text}</span>
                )}
              </div>
              {k.state === 'hibernated' && (
                <div className="jp-gpu-snapshot-item-actions">
                  <button
                    className="jp-Button jp-mod-styled jp-mod-accept jp-gpu-snapshot-wake"
                    title={trans.__('Restore the kernel now, in its own kernel slot')}
                    onClick={() => void this._wake(k)}
                  >
                    {trans.__('Wake')}
                  </button>
                </div>
              )}
            </li>
          ))}
        </ul>
      </section>
    );
  }

  private async _wake(kernel: IHibernation): Promise<void> {
    try {
      await this._controller.api.wake(kernel.kernel_id);
      this._error = null;
    } catch (error) {
      this._error = this._trans.__(
        'Could not wake the kernel: %1',
        (error as Error).message
      );
    }
    await this.reload();
  }

  /** The current notebook's autosave: policy, last and next autosave, and its override. */
  private _autosaveSection(): JSX.Element | null {
    const trans = this._trans;
    const state = this._autosave;
    if (
      !state ||
      state.kernel_id !== this._controller.kernelId(this._tracker.currentWidget)
    ) {
      return null;
    }
    // The notebook's hibernation times ride in the same policy; they have their sections.
    const overridden = Object.entries(state.override).some(
      ([k, v]) => !IDLE_FIELDS.includes(k) && v !== null && v !== undefined
    );
    const mode = !overridden ? 'default' : state.policy.enabled ? 'on' : 'off';
    const last = state.last_autosave;
    // Re-created when the server's answer changes, so the fields show what is in force.
    const formKey = `${state.kernel_id}:${JSON.stringify(state.policy)}:${mode}`;
    let modeInput: HTMLSelectElement | null = null;
    let intervalInput: HTMLInputElement | null = null;
    return (
      <section className="jp-gpu-snapshot-sidebar-section" data-section="autosave">
        <h3>{trans.__('Autosave')}</h3>
        <div className="jp-gpu-snapshot-autosave-policy">
          {overridden
            ? trans.__(
                "%1 (this notebook's setting)",
                describeAutosavePolicy(state.policy, trans)
              )
            : trans.__(
                "%1 (the server's setting)",
                describeAutosavePolicy(state.policy, trans)
              )}
        </div>
        <div className="jp-gpu-snapshot-autosave-next">
          {describeNextAutosave(state, undefined, trans)}
        </div>
        {last && (
          <div className="jp-gpu-snapshot-autosave-last" title={formatTime(last.created)}>
            {last.pause !== null
              ? trans.__(
                  'Last autosave %1, the kernel paused %2',
                  formatAge(last.created, undefined, trans),
                  formatSeconds(last.pause, trans)
                )
              : trans.__('Last autosave %1', formatAge(last.created, undefined, trans))}
          </div>
        )}
        {state.last_skip && (
          <div className="jp-gpu-snapshot-autosave-skip">
            {trans.__('Skipped: %1', state.last_skip)}
          </div>
        )}
        <form
          key={formKey}
          className="jp-gpu-snapshot-autosave-form"
          onSubmit={event => {
            event.preventDefault();
            void this._applyAutosave(
              modeInput?.value ?? mode,
              Number(intervalInput?.value)
            );
          }}
        >
          <select
            className="jp-gpu-snapshot-autosave-mode"
            aria-label={trans.__('Autosave for this notebook')}
            defaultValue={mode}
            ref={node => {
              modeInput = node;
            }}
          >
            <option value="default">{trans.__('Server setting')}</option>
            <option value="on">{trans.__('On')}</option>
            <option value="off">{trans.__('Off')}</option>
          </select>
          <label>
            {trans.__('every')}{' '}
            <input
              type="number"
              className="jp-gpu-snapshot-autosave-interval"
              aria-label={trans.__('Autosave interval in minutes')}
              min="0.1"
              step="any"
              defaultValue={state.policy.interval_minutes}
              ref={node => {
                intervalInput = node;
              }}
            />{' '}
            {trans.__('min')}
          </label>
          <button type="submit" className="jp-Button jp-mod-styled jp-mod-accept">
            {trans.__('Apply')}
          </button>
        </form>
      </section>
    );
  }

  /** The words of each tier's idle section. */
  private _idleWords(tier: HibernationTier): {
    title: string;
    mode: string;
    minutes: string;
    invalid: string;
    failed: (message: string) => string;
  } {
    const trans = this._trans;
    if (tier === 'gpu') {
      return {
        title: trans.__('GPU release'),
        mode: trans.__('GPU release for this notebook'),
        minutes: trans.__('Minutes idle before the kernel gives its GPU back'),
        invalid: trans.__(
          'The idle time before the GPU is released must be a number of minutes above 0.'
        ),
        failed: message => trans.__('Could not change the GPU release: %1', message)
      };
    }
    return {
      title: trans.__('Hibernation'),
      mode: trans.__('Hibernation for this notebook'),
      minutes: trans.__('Minutes idle before the kernel hibernates'),
      invalid: trans.__(
        'The idle time before hibernation must be a number of minutes above 0.'
      ),
      failed: message => trans.__('Could not change hibernation: %1', message)
    };
  }

  /**
   * When the current notebook's kernel hibernates once idle in ``tier``, and its own
   * choice of it.
   */
  private _idleSection(tier: HibernationTier): JSX.Element | null {
    const trans = this._trans;
    const state = this._autosave;
    const field = IDLE_POLICY_FIELDS[tier];
    const minutes = state?.policy[field];
    if (
      !state ||
      minutes === undefined ||
      state.kernel_id !== this._controller.kernelId(this._tracker.currentWidget)
    ) {
      return null; // older servers do not hibernate (in this tier)
    }
    const own = typeof state.override[field] === 'number';
    const mode = !own ? 'default' : minutes > 0 ? 'after' : 'never';
    const policy = describeIdlePolicy(tier, minutes, trans);
    const words = this._idleWords(tier);
    const section = IDLE_SECTIONS[tier];
    let modeInput: HTMLSelectElement | null = null;
    let minutesInput: HTMLInputElement | null = null;
    return (
      <section className="jp-gpu-snapshot-sidebar-section" data-section={section}>
        <h3>{words.title}</h3>
        <div className={`jp-gpu-snapshot-${section}-policy`}>
          {own
            ? trans.__("%1 (this notebook's setting)", policy)
            : trans.__("%1 (the server's setting)", policy)}
        </div>
        <form
          key={`${state.kernel_id}:${minutes}:${mode}`}
          className="jp-gpu-snapshot-autosave-form"
          onSubmit={event => {
            event.preventDefault();
            void this._applyIdleTime(
              tier,
              modeInput?.value ?? mode,
              Number(minutesInput?.value)
            );
          }}
        >
          <select
            className={`jp-gpu-snapshot-${section}-mode`}
            aria-label={words.mode}
            defaultValue={mode}
            ref={node => {
              modeInput = node;
            }}
          >
            <option value="default">{trans.__('Server setting')}</option>
            <option value="after">{trans.__('After')}</option>
            <option value="never">{trans.__('Never')}</option>
          </select>
          <label>
            <input
              type="number"
              className={`jp-gpu-snapshot-${section}-minutes`}
              aria-label={words.minutes}
              min="0.1"
              step="any"
              defaultValue={minutes > 0 ? minutes : tier === 'gpu' ? 10 : 30}
              ref={node => {
                minutesInput = node;
              }}
            />{' '}
            {trans.__('min idle')}
          </label>
          <button type="submit" className="jp-Button jp-mod-styled jp-mod-accept">
            {trans.__('Apply')}
          </button>
        </form>
      </section>
    );
  }

  /** Called by a tier's idle form: PUT the notebook's choice, show the new state. */
  private async _applyIdleTime(
    tier: HibernationTier,
    mode: string,
    minutes: number
  ): Promise<void> {
    const kernelId = this._controller.kernelId(this._tracker.currentWidget);
    if (!kernelId) {
      return;
    }
    const words = this._idleWords(tier);
    const override = idleOverride(tier, mode, minutes);
    if (!override) {
      this._error = words.invalid;
      this.update();
      return;
    }
    try {
      this._autosave = await this._controller.setAutosave(kernelId, override);
      this._error = null;
    } catch (error) {
      this._error = words.failed((error as Error).message);
    }
    this.update();
  }

  /** Called by the autosave form: PUT the notebook's override, show the new state. */
  private async _applyAutosave(mode: string, minutes: number): Promise<void> {
    const kernelId = this._controller.kernelId(this._tracker.currentWidget);
    if (!kernelId) {
      return;
    }
    let override: AutosaveOverride;
    if (mode === 'default') {
      override = { enabled: null, interval_minutes: null };
    } else if (mode === 'off') {
      override = { enabled: false };
    } else {
      if (!(minutes > 0)) {
        this._error = this._trans.__(
          'The autosave interval must be a number of minutes above 0.'
        );
        this.update();
        return;
      }
      override = { enabled: true, interval_minutes: minutes };
    }
    try {
      this._autosave = await this._controller.setAutosave(kernelId, override);
      this._error = null;
    } catch (error) {
      this._error = this._trans.__(
        'Could not change autosave: %1',
        (error as Error).message
      );
    }
    this.update();
  }

  private _section(
    title: string,
    snapshots: ISnapshotSummary[],
    panel: NotebookPanel | null,
    key: string
  ): JSX.Element {
    return (
      <section className="jp-gpu-snapshot-sidebar-section" data-section={key}>
        <h3>{title}</h3>
        {snapshots.length ? (
          <ul>{snapshots.map(s => this._item(s, panel))}</ul>
        ) : (
          <p className="jp-gpu-snapshot-empty">
            {this._search
              ? this._trans.__('None matches the search.')
              : this._trans.__('None.')}
          </p>
        )}
      </section>
    );
  }

  private _item(s: ISnapshotSummary, panel: NotebookPanel | null): JSX.Element {
    const trans = this._trans;
    const where = describeLocation(s, trans);
    const busy = panel !== null && this._controller.activeJob(panel) !== null;
    const target = panel?.context.localPath ?? null;
    const location = [s.host, s.notebook_path].filter(Boolean).join(': ');
    return (
      <li
        key={s.id}
        className="jp-gpu-snapshot-item"
        data-snapshot-id={s.id}
        data-snapshot-name={s.name}
      >
        <div className="jp-gpu-snapshot-item-title">
          <span className="jp-gpu-snapshot-name" title={s.id}>
            {s.name}
          </span>
          <span className="jp-gpu-snapshot-badge" data-reason={s.reason}>
            {reasonLabel(s.reason, trans)}
          </span>
          <FallbackOfferBadge snapshot={s} trans={trans} />
        </div>
        <div className="jp-gpu-snapshot-item-facts">
          <span title={formatTime(s.created)}>
            {formatAge(s.created, undefined, trans)}
          </span>
          <span>{formatSnapshotSize(s, trans)}</span>
          <span>{describeGpu(s, trans)}</span>
          {where && (
            <span className="jp-gpu-snapshot-location" data-location={s.location}>
              {where}
            </span>
          )}
        </div>
        <div className="jp-gpu-snapshot-item-location" title={location}>
          {location || trans.__('location unknown')}
        </div>
        <div className="jp-gpu-snapshot-item-actions">
          <button
            className="jp-Button jp-mod-styled jp-mod-accept jp-gpu-snapshot-restore"
            disabled={!panel || busy}
            title={
              target
                ? trans.__("Restore '%1' as the kernel of %2", s.name, target)
                : trans.__('Open a notebook to restore into')
            }
            onClick={() => {
              if (panel) {
                void this._controller.restore(panel, s).then(() => this._poll.refresh());
              }
            }}
          >
            {trans.__('Restore')}
          </button>
          <button
            className="jp-Button jp-mod-styled jp-mod-reject jp-gpu-snapshot-rename"
            title={trans.__('Give %1 another name', s.name)}
            onClick={() => void this._rename(s)}
          >
            {trans.__('Rename')}
          </button>
          {this._deleteButtons.render(s, trans, () => void this._delete(s))}
        </div>
      </li>
    );
  }

  /** Called by an item's Rename button: ask for the name, then PATCH the snapshot. */
  private async _rename(s: ISnapshotSummary): Promise<void> {
    const trans = this._trans;
    const answer = await InputDialog.getText({
      title: trans.__("Rename '%1'", s.name),
      label: trans.__(
        '1-64 letters, digits, ".", "_" or "-", starting with a letter or digit'
      ),
      text: s.name,
      okLabel: trans.__('Rename')
    });
    const name = answer.value?.trim();
    if (!answer.button.accept || !name || name === s.name) {
      return;
    }
    // The store's rule for names (core/store/snapshot.py, validate_name), checked before asking.
    if (!NAME_PATTERN.test(name) || /\.\.|[.-]$/.test(name)) {
      this._error = trans.__(
        'Could not rename \'%1\': invalid snapshot name \'%2\' (use 1-64 letters, digits, ".", "_" or "-", starting with a letter or digit)',
        s.name,
        name
      );
      this.update();
      return;
    }
    await this._change(
      () => this._controller.api.renameSnapshot(s.id, name),
      message => trans.__("Could not rename '%1': %2", s.name, message)
    );
  }

  private async _delete(s: ISnapshotSummary): Promise<void> {
    if (!this._deleteButtons.confirms(s.id)) {
      return;
    }
    await this._change(
      () => this._controller.api.deleteSnapshot(s.id),
      message => this._trans.__("Could not delete '%1': %2", s.name, message)
    );
  }

  /**
   * Rename or delete through ``run``; on failure show ``failed(message)``, else ask the
   * server again, here and for the status bar and the button, which may name the snapshot.
   */
  private async _change(
    run: () => Promise<unknown>,
    failed: (message: string) => string
  ): Promise<void> {
    try {
      await run();
    } catch (error) {
      this._error = failed((error as Error).message);
      this.update();
      return;
    }
    this._error = null;
    const kernelId = this._controller.kernelId(this._tracker.currentWidget);
    if (kernelId) {
      void this._controller.refresh(kernelId);
    }
    await this.reload();
  }

  private _snapshots: ISnapshotSummary[] = [];
  private _freeBytes: number | null = null;
  private _autosave: IAutosaveState | null = null;
  private _hibernated: IHibernation[] = [];
  private _search = '';
  private _sort: SortKey = 'newest';
  private readonly _deleteButtons = new DeleteButtons(() => this.update());
  /** What the last rename, delete or autosave change refused; stays until the next one works. */
  private _error: string | null = null;
  /** Why the last listing failed; the next listing clears it. */
  private _listingError: string | null = null;
  private _loaded = false;
  private _poll: Poll;
}
