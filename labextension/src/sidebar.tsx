/**
 * The Snapshots sidebar in JupyterLab's left area: the store's size on disk and its free
 * disk, this notebook's snapshots, its kernel's timeline (timeline.tsx), and all the other
 * snapshots, searchable and sortable, with restore, rename and delete; the server's
 * hibernated kernels; then this notebook's settings (autosave, and hibernation's two
 * tiers), folded away until asked for. Added to the shell by the plugin; it refreshes while
 * it is shown, and at once when the server says the listing changed (a job ended, a
 * snapshot was renamed or deleted anywhere, a notebook was renamed).
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import type { Event } from '@jupyterlab/services';
import type { TranslationBundle } from '@jupyterlab/translation';
import { ReactWidget } from '@jupyterlab/ui-components';
import { Poll } from '@lumino/polling';
import type { ISignal } from '@lumino/signaling';
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
  describeShutdownSave,
  formatAge,
  formatBytes,
  formatSnapshotSize,
  formatSeconds,
  formatTime,
  reasonLabel
} from './format';
import { FallbackOfferBadge } from './fallback';
import { snapshotIcon } from './icons';
import { JOB_EVENT_PREFIX } from './jobs';
import { askSnapshotName } from './names';
import { describeRefusal, heldByRunningKernel } from './remedy';
import type { Rewinder } from './rewind';
import { KernelTimeline, TimelineSection } from './timeline';

/** The server's events that change the listing without a job (event_schemas/snapshots-v1). */
export const SNAPSHOTS_EVENT_PREFIX =
  'https://events.jupyter.org/jupyter_gpu_snapshot/snapshots/';

type SortKey = 'newest' | 'oldest' | 'name' | 'size';

const SORTS: { [key in SortKey]: (a: ISnapshotSummary, b: ISnapshotSummary) => number } =
  {
    newest: (a, b) => b.created - a.created,
    oldest: (a, b) => a.created - b.created,
    name: (a, b) => a.name.localeCompare(b.name),
    size: (a, b) => b.size_bytes - a.size_bytes
  };

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

/**
 * What the Timeline section needs: the rewinds its buttons ask for, and JupyterLab's
 * NotebookActions.executed, which says a cell ended (its kernel took a new point).
 */
export interface ITimelineSource {
  rewinder: Rewinder;
  executed: ISignal<unknown, { notebook: unknown }>;
}

export class SnapshotsSidebar extends ReactWidget {
  /**
   * ``events``: the server's event stream, which makes changes show at once; ``timeline``:
   * where the Timeline section's kernel timeline comes from (none: no such section).
   */
  constructor(
    private readonly _controller: SnapshotController,
    private readonly _tracker: INotebookTracker,
    refreshSeconds: number,
    private readonly _trans: TranslationBundle,
    private readonly _events: Event.IManager | null = null,
    timeline: ITimelineSource | null = null
  ) {
    super();
    this.id = 'jp-gpu-snapshot-sidebar';
    this.addClass('jp-gpu-snapshot-sidebar');
    this.title.icon = snapshotIcon;
    this.title.caption = _trans.__('Snapshots');
    _tracker.currentChanged.connect(this._onCurrentChanged, this);
    _controller.changed.connect(() => this._poll.refresh());
    _events?.stream.connect(this._onEvent, this);
    this._poll = new Poll({
      auto: true,
      factory: () => this.reload(),
      frequency: { interval: refreshSeconds * 1000, backoff: true, max: 300_000 },
      name: 'jupyter-gpu-snapshot:sidebar',
      standby: () => !this.isVisible || 'when-hidden'
    });
    this._timeline = timeline
      ? new KernelTimeline(
          _controller.api,
          _controller,
          _tracker,
          timeline.rewinder,
          timeline.executed,
          refreshSeconds,
          () => this.isVisible
        )
      : null;
    this._timeline?.changed.connect(() => this.update());
  }

  /** Called by the plugin when the setting changes. */
  setRefreshSeconds(seconds: number): void {
    const interval = seconds * 1000;
    this._poll.frequency = { interval, backoff: true, max: 300_000 };
    this._timeline?.setRefreshSeconds(seconds);
  }

  async reload(): Promise<void> {
    try {
      const listing = await this._controller.api.listing();
      this._snapshots = listing.snapshots;
      this._freeBytes = listing.store?.free_bytes ?? null;
      await this._readDiskBytes();
      const kernelId = this._controller.polledKernel(this._tracker.currentWidget);
      // Servers without autosave answer 404: the section is left out.
      this._autosave = kernelId
        ? await this._controller.api.autosave(kernelId).catch(() => null)
        : null;
      // Servers without hibernation answer 404: the section is left out.
      this._hibernated = await this._controller.api.hibernation().catch(() => []);
      this._listingError = null;
      await this._forgetEndedRefusals();
    } catch (error) {
      this._listingError = (error as Error).message;
    }
    this._loaded = true;
    this.update();
  }

  dispose(): void {
    this._poll.dispose();
    this._timeline?.dispose();
    this._events?.stream.disconnect(this._onEvent, this);
    super.dispose();
  }

  protected onAfterShow(): void {
    void this._poll.refresh();
    void this._timeline?.refresh();
  }

  /**
   * What the store takes on disk, pages shared by snapshots counted once (GET usage):
   * asked again only when the set of snapshots changed, since it reads every recipe.
   */
  private async _readDiskBytes(): Promise<void> {
    const ids = this._snapshots.map(s => s.id).join(' ');
    if (ids === this._diskBytesOf) {
      return;
    }
    try {
      this._diskBytes = (await this._controller.api.usage()).disk_bytes;
    } catch {
      this._diskBytes = null; // an older server: the header says no size
    }
    this._diskBytesOf = ids;
  }

  /** A refusal for a snapshot that a job held (a restore, say) goes once that job ended. */
  private async _forgetEndedRefusals(): Promise<void> {
    for (const [id, refusal] of [...this._refusals]) {
      if (!this._snapshots.some(s => s.id === id)) {
        this._refusals.delete(id);
      } else if (refusal.jobId) {
        const job = await this._controller.api.getJob(refusal.jobId).catch(() => null);
        if (job?.status !== 'running') {
          this._refusals.delete(id);
        }
      }
    }
  }

  private _onCurrentChanged(): void {
    this._watchedPanel?.context.pathChanged.disconnect(this._onPathChanged, this);
    this._watchedPanel = this._tracker.currentWidget;
    this._watchedPanel?.context.pathChanged.connect(this._onPathChanged, this);
    this.update();
    void this._poll.refresh();
  }

  /** The notebook was renamed: the server moved its snapshots along; list them again. */
  private _onPathChanged(): void {
    void this._poll.refresh();
  }

  private _onEvent(_: unknown, event: Event.Emission): void {
    const schema = event.schema_id ?? '';
    const status = (event as unknown as { status?: unknown }).status;
    if (
      schema.startsWith(SNAPSHOTS_EVENT_PREFIX) ||
      (schema.startsWith(JOB_EVENT_PREFIX) && status !== 'running')
    ) {
      void this._poll.refresh();
    }
  }

  render(): JSX.Element {
    const trans = this._trans;
    const panel = this._tracker.currentWidget;
    const path = panel?.context.path ?? null;
    const kernelId = this._controller.kernelId(panel);
    const running = { kernelId, originId: this._controller.originOf(kernelId) };
    // This notebook's: those of its path, and those its running kernel holds.
    const isOwn = (s: ISnapshotSummary) =>
      path !== null &&
      (s.notebook_path === path || heldByRunningKernel(s, running, this._snapshots));
    const shown = this._snapshots
      .filter(s => matches(s, this._search))
      .sort(SORTS[this._sort]);
    const own = shown.filter(isOwn);
    const others = shown.filter(s => !isOwn(s));
    return (
      <div className="jp-gpu-snapshot-sidebar-body">
        <header className="jp-gpu-snapshot-sidebar-header">
          <h2>{trans.__('Snapshots')}</h2>
          <div
            className="jp-gpu-snapshot-store"
            title={trans.__(
              'The snapshot store on the server: what its snapshots take on disk (pages they share counted once), and the free disk'
            )}
          >
            {this._storeText()}
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
        {this._listingError && (
          <p className="jp-gpu-snapshot-error">{this._listingError}</p>
        )}
        {!this._loaded ? (
          <p className="jp-gpu-snapshot-empty">{trans.__('Loading snapshots…')}</p>
        ) : (
          <>
            {path && this._shutdownWarning(kernelId)}
            {path &&
              this._section(trans.__('This notebook: %1', path), own, panel, 'own')}
            {path && this._timeline && (
              <TimelineSection model={this._timeline} panel={panel} trans={trans} />
            )}
            {this._section(
              path ? trans.__('All others') : trans.__('All snapshots'),
              others,
              panel,
              'others'
            )}
            {this._hibernationSection()}
            {path && this._settings(kernelId)}
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

  /** "3 in the store, 1.2 GiB on disk, 40.0 GiB free". */
  private _storeText(): string {
    const trans = this._trans;
    const count = this._snapshots.length;
    const parts = [trans._n('%1 in the store', '%1 in the store', count)];
    if (this._diskBytes !== null) {
      parts.push(trans.__('%1 on disk', formatBytes(this._diskBytes, trans)));
    }
    if (this._freeBytes !== null) {
      parts.push(trans.__('%1 free', formatBytes(this._freeBytes, trans)));
    }
    return parts.join(', ');
  }

  /**
   * A warning when the notebook's kernel has grown too big for its save at shutdown: the
   * server would stop it without a save, and a restart would offer an older snapshot.
   */
  private _shutdownWarning(kernelId: string | null): JSX.Element | null {
    const save = this._controller.entry(kernelId)?.status?.shutdown_save;
    const text = describeShutdownSave(save ?? null, this._trans);
    return text ? (
      <p className="jp-gpu-snapshot-warning" data-warning="shutdown">
        {text}
      </p>
    ) : null;
  }

  /**
   * This notebook's settings, folded: autosave, and the idle times of hibernation's two
   * tiers (the GPU tier only for a kernel that holds GPU memory).
   */
  private _settings(kernelId: string | null): JSX.Element | null {
    const autosave = this._autosaveSection();
    if (!autosave) {
      return null;
    }
    const cuda = this._controller.entry(kernelId)?.status?.cuda;
    const usesGpu = cuda === null || cuda === undefined || cuda.state !== 'none';
    return (
      <details
        className="jp-gpu-snapshot-settings"
        open={this._settingsOpen}
        onToggle={event => {
          this._settingsOpen = (event.target as HTMLDetailsElement).open;
        }}
      >
        <summary>{this._trans.__("This notebook's settings")}</summary>
        {this._settingsError && (
          <p className="jp-gpu-snapshot-error">{this._settingsError}</p>
        )}
        {autosave}
        {usesGpu && this._idleSection('gpu')}
        {this._idleSection('process')}
      </details>
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
        {this._wakeError && <p className="jp-gpu-snapshot-error">{this._wakeError}</p>}
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
      this._wakeError = null;
    } catch (error) {
      this._wakeError = this._trans.__(
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
      this._settingsError = words.invalid;
      this.update();
      return;
    }
    try {
      this._autosave = await this._controller.setAutosave(kernelId, override);
      this._settingsError = null;
    } catch (error) {
      this._settingsError = words.failed((error as Error).message);
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
        this._settingsError = this._trans.__(
          'The autosave interval must be a number of minutes above 0.'
        );
        this.update();
        return;
      }
      override = { enabled: true, interval_minutes: minutes };
    }
    try {
      this._autosave = await this._controller.setAutosave(kernelId, override);
      this._settingsError = null;
    } catch (error) {
      this._settingsError = this._trans.__(
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
    const refusal = this._refusals.get(s.id);
    const saved =
      s.saved_notebook_path && s.saved_notebook_path !== s.notebook_path
        ? trans.__('saved as %1', s.saved_notebook_path)
        : null;
    const origin = [
      s.host ? trans.__('saved on %1', s.host) : null,
      saved,
      trans.__('id %1', s.id)
    ]
      .filter(Boolean)
      .join('; ');
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
        <div className="jp-gpu-snapshot-item-location" title={origin}>
          {s.notebook_path ?? trans.__('no notebook')}
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
                void this._controller
                  .restoreAsked(panel, s, {}, this._snapshots)
                  .then(() => this._poll.refresh());
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
        {refusal && (
          <div className="jp-gpu-snapshot-error jp-gpu-snapshot-item-error" role="alert">
            <span>{refusal.message}</span>
            <button
              className="jp-gpu-snapshot-dismiss"
              title={trans.__('Dismiss')}
              aria-label={trans.__('Dismiss')}
              onClick={() => {
                this._refusals.delete(s.id);
                this.update();
              }}
            >
              ×
            </button>
          </div>
        )}
      </li>
    );
  }

  /** Called by an item's Rename button: ask for a valid, free name, then PATCH it. */
  private async _rename(s: ISnapshotSummary): Promise<void> {
    const trans = this._trans;
    const answer = await askSnapshotName({
      title: trans.__("Rename '%1'", s.name),
      okLabel: trans.__('Rename'),
      text: s.name,
      taken: this._snapshots.filter(other => other.id !== s.id).map(other => other.name),
      trans
    });
    if (!answer) {
      return;
    }
    await this._change(s, () => this._controller.api.renameSnapshot(s.id, answer.name));
  }

  private async _delete(s: ISnapshotSummary): Promise<void> {
    if (!this._deleteButtons.confirms(s.id)) {
      return;
    }
    await this._change(s, () => this._controller.api.deleteSnapshot(s.id));
  }

  /**
   * Rename or delete ``s`` through ``run``; a refusal shows under its item, in words, until
   * dismissed or, for a snapshot a job held, until that job ended; else ask the server
   * again, here and for the status bar and the button, which may name the snapshot.
   */
  private async _change(s: ISnapshotSummary, run: () => Promise<unknown>): Promise<void> {
    try {
      await run();
    } catch (error) {
      const jobId =
        (error as { error?: { details?: { job_id?: string } } }).error?.details?.job_id ??
        null;
      this._refusals.set(s.id, { message: describeRefusal(error, this._trans), jobId });
      this.update();
      return;
    }
    this._refusals.delete(s.id);
    const kernelId = this._controller.kernelId(this._tracker.currentWidget);
    if (kernelId) {
      void this._controller.refresh(kernelId);
    }
    await this.reload();
  }

  private _snapshots: ISnapshotSummary[] = [];
  private _freeBytes: number | null = null;
  /** The store's bytes on disk (GET usage), and the snapshots they were read for. */
  private _diskBytes: number | null = null;
  private _diskBytesOf: string | null = null;
  private _autosave: IAutosaveState | null = null;
  private _hibernated: IHibernation[] = [];
  private _search = '';
  private _sort: SortKey = 'newest';
  private _settingsOpen = false;
  private _watchedPanel: NotebookPanel | null = null;
  private readonly _deleteButtons = new DeleteButtons(() => this.update());
  /** Why a rename or delete of each snapshot was refused, and the job that held it. */
  private _refusals = new Map<string, { message: string; jobId: string | null }>();
  /** Why the last Wake failed; the next one that works clears it. */
  private _wakeError: string | null = null;
  /** What the last settings change refused; stays until the next one works. */
  private _settingsError: string | null = null;
  /** Why the last listing failed; the next listing clears it. */
  private _listingError: string | null = null;
  private _loaded = false;
  private _poll: Poll;
  /** The current notebook kernel's timeline; null without a timeline source. */
  private readonly _timeline: KernelTimeline | null;
}
