/**
 * jupyter-gpu-snapshot: snapshot a notebook's kernel (CUDA state included) and restore it.
 *
 * The toolbar button, the Kernel menu entries and the cells' context menu entry are
 * declared in schema/plugin.json; this file supplies the commands and widgets they name.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import {
  ICommandPalette,
  IToolbarWidgetRegistry,
  Notification
} from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStateDB } from '@jupyterlab/statedb';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';
import { Signal } from '@lumino/signaling';
import { SnapshotAPI } from './api';
import { SnapshotButton } from './button';
import { SnapshotController } from './controller';
import { DeathNotice } from './death';
import { pickSnapshot } from './dialog';
import { restoreIcon, snapshotIcon } from './icons';
import { askSnapshotName } from './names';
import { ShutdownOffer } from './reboot';
import { REWIND_EVENT_PREFIX, Rewinder, rewindAvailability } from './rewind';
import { SNAPSHOTS_EVENT_PREFIX, SnapshotsSidebar } from './sidebar';
import { DEFAULT_REFRESH_SECONDS, SnapshotStatusItem } from './statusbar';
import { TRANSLATION_DOMAIN } from './translation';
import type { ICellLike } from './undone';

const PLUGIN_ID = 'jupyter-gpu-snapshot:plugin';

/** The server's hibernation events (server/event_schemas/hibernation-v1.yaml), any version. */
const HIBERNATION_EVENT_PREFIX =
  'https://events.jupyter.org/jupyter_gpu_snapshot/hibernation/';

export namespace CommandIDs {
  export const save = 'gpu-snapshot:save';
  export const saveNamed = 'gpu-snapshot:save-named';
  export const restore = 'gpu-snapshot:restore';
  export const hibernate = 'gpu-snapshot:hibernate';
  export const rewindToCell = 'gpu-snapshot:rewind-to-cell';
}

/** The toolbar item name used in schema/plugin.json. */
const TOOLBAR_ITEM = 'gpu-snapshot';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'Snapshot a notebook kernel (CUDA state included) and restore it into the notebook.',
  autoStart: true,
  requires: [INotebookTracker, IToolbarWidgetRegistry],
  optional: [ICommandPalette, IStatusBar, ISettingRegistry, IStateDB, ITranslator],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    toolbarRegistry: IToolbarWidgetRegistry,
    palette: ICommandPalette | null,
    statusBar: IStatusBar | null,
    settingRegistry: ISettingRegistry | null,
    stateDB: IStateDB | null,
    translator: ITranslator | null
  ) => {
    const trans = (translator ?? nullTranslator).load(TRANSLATION_DOMAIN);
    const controller = new SnapshotController(
      new SnapshotAPI(undefined, trans),
      app.serviceManager,
      trans
    );
    const current = (): NotebookPanel | null => tracker.currentWidget;
    let askedPortable = false;

    app.commands.addCommand(CommandIDs.save, {
      label: trans.__('Snapshot Kernel'),
      caption: () => controller.saveAvailability(current()).reason,
      icon: snapshotIcon,
      isEnabled: () => controller.saveAvailability(current()).enabled,
      execute: async () => {
        const panel = current();
        if (panel) {
          await controller.save(panel);
        }
      }
    });

    app.commands.addCommand(CommandIDs.saveNamed, {
      label: trans.__('Snapshot Kernel As…'),
      caption: trans.__('Snapshot the kernel under a name of your choice'),
      isEnabled: () => controller.saveAvailability(current()).enabled,
      execute: async () => {
        const panel = current();
        if (!panel) {
          return;
        }
        // The names in use, so that the dialog refuses a taken one as it is typed.
        const taken = await controller.api
          .listSnapshots()
          .then(all => all.map(s => s.name))
          .catch(() => []);
        const answer = await askSnapshotName({
          title: trans.__('Snapshot kernel as'),
          okLabel: trans.__('Snapshot'),
          // An example of a valid name: ASCII in every language.
          placeholder: 'before-training',
          taken,
          checkbox: {
            label: trans.__('Also save a portable copy'),
            caption: trans.__(
              "Also keep the kernel's variables in a portable form (tensors and arrays in safetensors, the rest through dill): a fresh kernel can load them where the snapshot's image cannot come back, e.g. on another GPU or driver. The save takes longer."
            ),
            checked: askedPortable
          },
          trans
        });
        if (!answer) {
          return;
        }
        // The next save asks the same way until the user says otherwise.
        askedPortable = answer.checked ?? askedPortable;
        await controller.save(panel, answer.name, { portable: answer.checked === true });
      }
    });

    app.commands.addCommand(CommandIDs.restore, {
      label: trans.__('Restore Kernel from Snapshot…'),
      caption: trans.__(
        "Pick a snapshot and restore it as this notebook's kernel; snapshots can be deleted there too"
      ),
      icon: restoreIcon,
      isEnabled: () => {
        const panel = current();
        return panel !== null && controller.activeJob(panel) === null;
      },
      execute: async () => {
        const panel = current();
        if (!panel) {
          return;
        }
        const kernelId = controller.kernelId(panel);
        // A deleted snapshot may have been the one the status bar and the button report.
        const picked = await pickSnapshot(
          controller.api,
          panel.context.path,
          () => {
            if (kernelId) {
              void controller.refresh(kernelId);
            }
          },
          { kernelId, originId: controller.originOf(kernelId) },
          trans
        );
        if (picked && !panel.isDisposed) {
          await controller.restoreAsked(
            panel,
            picked.snapshot,
            picked.fallback ? { fallback: picked.fallback } : {},
            picked.listing
          );
        }
      }
    });

    app.commands.addCommand(CommandIDs.hibernate, {
      label: trans.__('Hibernate Kernel'),
      caption: trans.__(
        'Save the kernel and end its process so that its GPU memory is free; the next cell wakes it with everything in place'
      ),
      isEnabled: () => controller.saveAvailability(current()).enabled,
      execute: async () => {
        const kernelId = controller.kernelId(current());
        if (!kernelId) {
          return;
        }
        try {
          await controller.api.hibernate(kernelId);
        } catch (error) {
          Notification.error(
            trans.__('Could not hibernate the kernel: %1', (error as Error).message),
            { autoClose: false }
          );
        }
        await controller.refresh(kernelId);
      }
    });

    const rewinder = new Rewinder(controller.api, trans, kernelId => {
      const panels: NotebookPanel[] = [];
      tracker.forEach(panel => {
        if (controller.kernelId(panel) === kernelId) {
          panels.push(panel);
        }
      });
      return panels;
    });
    /**
     * The notebook and the cell a rewind is about: the cell whose context menu is open,
     * else the current notebook's active cell.
     */
    const rewindTarget = (): { panel: NotebookPanel | null; cell: ICellLike | null } => {
      const node = app.contextMenuHitTest(node => node.classList.contains('jp-Cell'));
      const panel = node
        ? (tracker.find(panel => panel.node.contains(node)) ?? null)
        : current();
      const cells = (panel?.content.widgets ?? []) as unknown as readonly ICellLike[];
      const cell = node
        ? (cells.find(cell => cell.node === node) ?? null)
        : ((panel?.content.activeCell ?? null) as unknown as ICellLike | null);
      return { panel, cell };
    };
    const rewindAsked = () => {
      const { panel, cell } = rewindTarget();
      const kernelId = controller.kernelId(panel);
      return { panel, kernelId, ...rewindAvailability(kernelId, cell, trans) };
    };

    app.commands.addCommand(CommandIDs.rewindToCell, {
      label: trans.__('Rewind kernel to before this cell'),
      caption: () => rewindAsked().reason,
      isEnabled: () => rewindAsked().enabled,
      execute: async () => {
        const { panel, kernelId, enabled, count } = rewindAsked();
        if (panel && kernelId && enabled && count !== null) {
          await rewinder.rewind(panel, kernelId, count);
        }
      }
    });

    controller.showsSession = sessionId =>
      tracker.find(panel => panel.sessionContext.session?.id === sessionId) !== undefined;

    controller.changeKernel = panel => {
      void panel.sessionContext.ready.then(() =>
        app.commands.execute('notebook:change-kernel')
      );
    };

    const notify = () => {
      app.commands.notifyCommandChanged(CommandIDs.save);
      app.commands.notifyCommandChanged(CommandIDs.saveNamed);
      app.commands.notifyCommandChanged(CommandIDs.restore);
      app.commands.notifyCommandChanged(CommandIDs.hibernate);
    };
    controller.changed.connect(notify);
    tracker.currentChanged.connect(notify);

    if (palette) {
      const category = trans.__('Kernel');
      palette.addItem({ command: CommandIDs.save, category });
      palette.addItem({ command: CommandIDs.saveNamed, category });
      palette.addItem({ command: CommandIDs.restore, category });
      palette.addItem({ command: CommandIDs.hibernate, category });
      // The active cell's rewind, when no context menu names one.
      palette.addItem({ command: CommandIDs.rewindToCell, category });
    }

    toolbarRegistry.addFactory<NotebookPanel>(
      'Notebook',
      TOOLBAR_ITEM,
      panel =>
        new SnapshotButton(
          panel,
          controller,
          () => {
            void app.commands.execute(CommandIDs.saveNamed);
          },
          trans
        )
    );

    let statusItem: SnapshotStatusItem | null = null;
    if (statusBar) {
      const item = new SnapshotStatusItem(
        tracker,
        controller,
        () => {
          void app.commands.execute(CommandIDs.restore);
        },
        trans
      );
      const activeStateChanged = new Signal<SnapshotStatusItem, void>(item);
      item.changed = () => activeStateChanged.emit();
      statusItem = item;
      statusBar.registerStatusItem(PLUGIN_ID, {
        item,
        align: 'left',
        rank: 5,
        isActive: () => item.visible,
        activeStateChanged
      });
    }

    const sidebar = new SnapshotsSidebar(
      controller,
      tracker,
      DEFAULT_REFRESH_SECONDS,
      trans,
      app.serviceManager.events ?? null,
      { rewinder, executed: NotebookActions.executed }
    );
    app.shell.add(sidebar, 'left', { rank: 850 });

    // A kernel that died and was replaced by a blank one: say so, offer its snapshot.
    new DeathNotice(
      controller,
      kernelId => tracker.find(panel => controller.kernelId(panel) === kernelId) ?? null,
      app.serviceManager.events ?? null,
      trans
    );

    // A kernel that hibernated or woke: its notebook's status bar says so at once. A
    // kernel rewound through the server, here or elsewhere: its notebooks mark the cells
    // whose effects are gone. A snapshot renamed or deleted anywhere, or a notebook
    // renamed: the current notebook's status names its newest snapshot again.
    app.serviceManager.events?.stream.connect((_, event) => {
      const kernelId = (event as unknown as { kernel_id?: unknown }).kernel_id;
      if (
        event.schema_id?.startsWith(HIBERNATION_EVENT_PREFIX) &&
        typeof kernelId === 'string' &&
        tracker.find(panel => controller.kernelId(panel) === kernelId)
      ) {
        void controller.refresh(kernelId);
      } else if (
        event.schema_id?.startsWith(REWIND_EVENT_PREFIX) &&
        typeof kernelId === 'string'
      ) {
        const report = (event as unknown as { report?: { undone?: unknown } }).report;
        const undone = Array.isArray(report?.undone)
          ? report.undone.filter((count): count is number => typeof count === 'number')
          : [];
        rewinder.onRewindEvent(kernelId, { undone });
      } else if (event.schema_id?.startsWith(SNAPSHOTS_EVENT_PREFIX)) {
        const current = controller.polledKernel(tracker.currentWidget);
        if (current) {
          void controller.refresh(current);
        }
      }
    });

    const offer = new ShutdownOffer(
      controller,
      stateDB,
      trans,
      path => tracker.find(panel => panel.context.path === path) ?? null
    );
    let offerAfterShutdown = true;
    tracker.widgetAdded.connect((_, panel) => {
      if (offerAfterShutdown) {
        void offer.check(panel);
      }
    });
    if (settingRegistry) {
      void settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          const read = () => {
            offerAfterShutdown = settings.get('offerRestoreAfterShutdown')
              .composite as boolean;
            controller.followInterval = settings.get('followJobMilliseconds')
              .composite as number;
            const seconds = settings.get('statusRefreshSeconds').composite as number;
            statusItem?.setRefreshSeconds(seconds);
            sidebar.setRefreshSeconds(seconds);
          };
          read();
          settings.changed.connect(read);
        })
        .catch(reason => {
          console.error('jupyter-gpu-snapshot: cannot load settings', reason);
        });
    }
  }
};

export default plugin;
